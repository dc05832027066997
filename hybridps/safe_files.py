"""File-system steps that never follow a symbolic link (no torch, no grpc).

A server that writes files for its clients must not be redirected by a link someone
planted on the way: it walks a path one directory at a time, each opened relative to its
parent's descriptor with O_NOFOLLOW (openat), so a link anywhere on the walk is refused
(`LinkRefused`), and a link swapped in after a check changes nothing (the descriptors
already held are the directories checked). A file is written under a temporary name,
created with O_EXCL | O_NOFOLLOW, and renamed over the final name: a link at that name is
replaced, never followed. Directories and files are created with the process's umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import zlib
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CRC_BLOCK = 16 * 2**20


class LinkRefused(OSError):
    """A path component that is a symbolic link (errno ELOOP)."""


def _refuse_link(parent_fd: int, name: str, exc: OSError) -> OSError:
    """The error of a failed no-follow open: LinkRefused when `name` is a link."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return exc
    if stat.S_ISLNK(st.st_mode):
        return LinkRefused(errno.ELOOP, "is a symbolic link", name)
    return exc


def open_dir(parent_fd: int, name: str, *, create: bool = False) -> int:
    """The descriptor of directory `name` in `parent_fd` (created when missing and
    `create`), never through a link; the caller closes it."""
    if name in ("", ".", "..") or "/" in name:
        raise OSError(errno.EINVAL, "not a single path component", name)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o777, dir_fd=parent_fd)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _refuse_link(parent_fd, name, exc) from None


def open_path(start: str | os.PathLike[str], parts: Sequence[str], *,
              create_from: int | None = None) -> int:
    """The descriptor of start/parts[0]/.../parts[-1], every part opened relative to the
    one before without following links; parts from index `create_from` on are created
    when missing. `start` itself must be a directory, not a link."""
    fd = os.open(start, DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            create = create_from is not None and i >= create_from
            inner = open_dir(fd, part, create=create)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def exists_at(dir_fd: int, name: str) -> bool:
    """Whether anything (a link too) is at `name` in the directory."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def read_file_at(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of regular file `name` in the directory (None when there is none); a
    link is LinkRefused, anything else or a file over `limit` bytes an OSError."""
    found = read_file_stat_at(dir_fd, name, limit)
    return None if found is None else found[0]


def read_file_stat_at(dir_fd: int, name: str, limit: int
                      ) -> tuple[bytes, os.stat_result] | None:
    """`read_file_at` with the status of the very file read (its owner, say), taken
    from the open descriptor so that a file swapped in meanwhile cannot lend its own."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _refuse_link(dir_fd, name, exc) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", name)
        return f.read(limit + 1), st


def _crc32(f: BinaryIO) -> str:
    f.seek(0)
    crc = 0
    while block := f.read(CRC_BLOCK):
        crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def atomic_write_at(dir_fd: int, relpath: str, write: Callable[[BinaryIO], Any]
                    ) -> dict[str, Any]:
    """write(f) into `relpath` below the directory: its directories are created when
    missing (never through a link), the file is written under a temporary name,
    fsynced and renamed into place. Returns {bytes, crc32} of what is on disk."""
    *dirs, name = relpath.split("/")
    fd = os.dup(dir_fd)
    try:
        for part in dirs:
            inner = open_dir(fd, part, create=True)
            os.close(fd)
            fd = inner
        if name in ("", ".", ".."):
            raise OSError(errno.EINVAL, "not a file name", relpath)
        tmp = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o666, dir_fd=fd)
        try:
            with os.fdopen(tmp_fd, "w+b") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
                crc = _crc32(f)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": size, "crc32": crc}


def create_exclusive(directory: str | os.PathLike[str], name: str, data: bytes,
                     mode: int) -> bool:
    """Create regular file `name` in `directory` holding `data` (with `mode`), all at
    once: written under a temporary name, then hard-linked to `name`, so a reader sees
    no file or the whole one. False when `name` exists already (nothing changed)."""
    fd = os.open(directory, DIR_FLAGS)
    try:
        tmp = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode, dir_fd=fd)
        try:
            with os.fdopen(tmp_fd, "wb") as f:
                os.fchmod(f.fileno(), mode)  # whatever the umask: readable as documented
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                return False
            with contextlib.suppress(OSError):
                os.fsync(fd)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
    finally:
        os.close(fd)
