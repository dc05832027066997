"""Where the shard server writes and reads a run's checkpoint files (transport-free).

The rules (docs/deploy.md, "Checkpoint root" and "Run secrets"):
- Inside --checkpoint-root only. A request names a directory inside it (relative to it,
  or absolute); one that resolves outside it (`..`, a symbolic link) is PermissionDenied
  naming it and the root.
- Never through a link. A path whose resolution differs from its text has a link on it
  and is refused; the server then walks it from the root one directory at a time without
  following links (hybridps/safe_files.py), so a link swapped in after the check
  redirects nothing.
- Only the run's own directory. A checkpoint is a step directory directly inside a *run
  directory* that the run claimed: its owner file (hybridps/run_secret.py) holds the
  digest of the run secret of every partition saved into it. The server never creates a
  run directory (the run's workers do, as their user, and claim it), so it never writes
  into a directory its client could not; below it, it creates the step directory and
  its optim/ with its own umask. A restore reads only from a step directory of a run
  directory claimed by the caller's run secret (or the restore secret it carries).
- A claim is the owner file of the run directory itself, never of one above it, and it
  counts only when the same user owns the file and the directory. Creating a file in a
  directory does not give a right to the directories already in it: in a shared root
  (mode 1777) anybody can add an owner file, but not write into another user's run
  directory there, so an owner file in a directory its writer does not own claims
  nothing. Below the run directory every directory the server writes into belongs to
  the run's user (that owner) or to the server (made by it for the run).
- Never over a complete checkpoint: a step directory with a manifest.json is refused.
- Files are written under a temporary name and renamed into place.
- A directory the file system will not take (a name too long, a path through a file, a
  full or read-only disk) is a refusal naming it (`write_refusal`), not an internal error.

Without a root (in-process stores of tests and tools) every path is taken as given and
nothing is claimed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from hybridps.checkpoint import MANIFEST, Writer, atomic_write
from hybridps.errors import (
    Conflict,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ShardError,
)
from hybridps.run_secret import (
    MAX_OWNER_BYTES,
    OWNER_FILE,
    RunClaimError,
    digests_match,
    parse_owner,
)
from hybridps.safe_files import (
    LinkRefused,
    atomic_write_at,
    exists_at,
    open_dir,
    open_path,
    read_file_stat_at,
)


def write_refusal(exc: OSError, directory: Path, what: str) -> ShardError:
    """The refusal of a checkpoint write the file system failed: the request's fault
    (a name too long, a path through a file: InvalidArgument), no room
    (ResourceExhausted) or no right (PermissionDenied); the message names the directory."""
    text = f"{what}: cannot write into checkpoint directory {str(directory)!r}: " + (
        exc.strerror or str(exc))
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE):
        return ResourceExhausted(text)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(text)
    return InvalidArgument(text)


class CheckpointRoot:
    """The requested checkpoint directories of runs, checked against one root (None:
    anywhere, for in-process use; the server always has a root)."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = None if root is None else Path(os.path.realpath(root))

    def resolve(self, directory: str, what: str) -> Path:
        """The directory a request names, inside the root and with no link on its way."""
        if not directory:
            raise InvalidArgument(f"{what}: the checkpoint directory must not be empty")
        if "\x00" in directory:
            raise InvalidArgument(f"{what}: checkpoint directory {directory!r} contains NUL")
        if self.root is None:
            return Path(directory)
        asked = self.root / directory  # an absolute `directory` wins
        resolved = Path(os.path.realpath(asked))
        if resolved != self.root and self.root not in resolved.parents:
            raise PermissionDenied(
                f"{what}: checkpoint directory {directory!r} resolves to {str(resolved)!r}, "
                f"outside this server's --checkpoint-root {str(self.root)!r}; checkpoints "
                "are written and read only inside it")
        lexical = Path(os.path.normpath(asked))
        if lexical != resolved:
            raise PermissionDenied(
                f"{what}: checkpoint directory {directory!r} passes through a symbolic link "
                f"(it resolves to {str(resolved)!r}); inside --checkpoint-root "
                f"{str(self.root)!r} the server follows no links: name the directory itself")
        return resolved

    def _parts(self, path: Path) -> list[str]:
        assert self.root is not None
        return list(path.relative_to(self.root).parts)

    def _open(self, path: Path, what: str) -> int:
        """A descriptor of directory `path` (inside the root), opened without links."""
        assert self.root is not None
        try:
            return open_path(self.root, self._parts(path))
        except LinkRefused:
            raise PermissionDenied(f"{what}: checkpoint directory {str(path)!r} passes "
                                   "through a symbolic link; the server follows none inside "
                                   f"--checkpoint-root {str(self.root)!r}") from None
        except FileNotFoundError:
            raise PermissionDenied(
                f"{what}: checkpoint directory {str(path)!r} does not exist; the server "
                "creates no run directory: the run's workers create and claim it "
                "(--checkpoint-dir)") from None
        except OSError as exc:
            raise write_refusal(exc, path, what) from exc

    def _check_owner(self, dir_fd: int, path: Path, digests: Sequence[str], what: str) -> int:
        """The owner file in the directory itself names one of `digests` and is of the
        directory's own user (module doc); PermissionDenied otherwise. Returns that
        user's uid: the run's."""
        try:
            found = read_file_stat_at(dir_fd, OWNER_FILE, MAX_OWNER_BYTES)
            owner = None if found is None else parse_owner(found[0], str(path / OWNER_FILE))
            dir_uid = os.fstat(dir_fd).st_uid
        except (OSError, RunClaimError) as exc:
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise PermissionDenied(f"{what}: cannot read the owner file of checkpoint "
                                   f"directory {str(path)!r}: {text}") from None
        if owner is None or found is None:
            raise PermissionDenied(
                f"{what}: checkpoint directory {str(path)!r} is claimed by no run (no "
                f"{OWNER_FILE}); the server writes and restores only in a directory the "
                "run's workers claimed with the run's secret (--checkpoint-dir)")
        if found[1].st_uid != dir_uid:
            raise PermissionDenied(
                f"{what}: checkpoint directory {str(path)!r} is claimed by no run: its "
                f"{OWNER_FILE} belongs to uid {found[1].st_uid}, the directory to uid "
                f"{dir_uid}; a run claims only a directory its own user owns (its workers "
                "create it: --checkpoint-dir), never a shared one above its run directories")
        if not digests or not any(digests_match(owner, d) for d in digests):
            raise PermissionDenied(
                f"{what}: checkpoint directory {str(path)!r} belongs to another run (its "
                f"{OWNER_FILE} does not name the run secret this request proves); a run "
                "writes and restores only its own checkpoints")
        return dir_uid

    def check_run_directory(self, directory: str, digest: str, what: str) -> Path:
        """A Register's --checkpoint-dir: inside the root, no link on its way, claimed by
        the run secret of `digest`. Returns it resolved."""
        path = self.resolve(directory, what)
        if self.root is None:
            return path
        if not digest:
            raise PermissionDenied(f"{what}: naming a checkpoint directory needs the run "
                                   "secret (metadata hybridps-run-secret)")
        fd = self._open(path, what)
        try:
            self._check_owner(fd, path, [digest], what)
        finally:
            os.close(fd)
        return path

    def check_restore(self, directory: str, digests: Sequence[str], what: str) -> Path:
        """A restore's step directory: inside the root, no link on its way, in a run
        directory claimed by one of `digests` (the caller's run and restore secrets)."""
        path = self.resolve(directory, what)
        if self.root is None:
            return path
        run_dir = self._run_directory(path, directory, what)
        fd = self._open(run_dir, what)
        try:
            self._check_owner(fd, run_dir, [d for d in digests if d], what)
        finally:
            os.close(fd)
        return path

    def _run_directory(self, path: Path, directory: str, what: str) -> Path:
        assert self.root is not None
        if path == self.root:
            raise PermissionDenied(f"{what}: checkpoint directory {directory!r} is the "
                                   "--checkpoint-root itself; name a step directory inside "
                                   "a run's directory")
        return path.parent

    @contextlib.contextmanager
    def step_writer(self, directory: str, digests: Sequence[str], what: str
                    ) -> Iterator[tuple[Path, Writer]]:
        """(the step directory, a writer of files below it) for a checkpoint of partitions
        whose run secrets' digests are `digests` (every one must own the run directory)."""
        path = self.resolve(directory, what)
        if self.root is None:
            yield path, lambda rel, write: atomic_write(path / rel, write)
            return
        run_dir = self._run_directory(path, directory, what)
        fd = self._open(run_dir, what)
        try:
            missing = [d for d in digests if not d]
            if missing or not digests:
                raise PermissionDenied(
                    f"{what}: the run registered without a run secret (metadata "
                    "hybridps-run-secret), so it owns no checkpoint directory to write into")
            run_uid = -1
            for digest in set(digests):
                run_uid = self._check_owner(fd, run_dir, [digest], what)
            ours = RunDirectories(run_dir, run_uid, what)
            self._check_not_complete(fd, path, ours, what)
            step = path.name

            def write(rel: str, fn: Callable[[BinaryIO], Any]) -> dict[str, Any]:
                *dirs, name = f"{step}/{rel}".split("/")
                try:
                    inner = ours.open_below(fd, dirs)
                    try:
                        return atomic_write_at(inner, name, fn)
                    finally:
                        os.close(inner)
                except LinkRefused:
                    raise PermissionDenied(
                        f"{what}: {str(path / rel)!r} passes through a symbolic link; the "
                        "server follows none inside --checkpoint-root") from None
                except OSError as exc:
                    raise write_refusal(exc, path, what) from exc

            yield path, write
        finally:
            os.close(fd)

    @staticmethod
    def _check_not_complete(run_fd: int, path: Path, ours: RunDirectories,
                            what: str) -> None:
        try:
            step_fd = open_dir(run_fd, path.name)
        except FileNotFoundError:
            return  # created by the first file written
        except LinkRefused:
            raise PermissionDenied(f"{what}: step directory {str(path)!r} is a symbolic "
                                   "link; the server follows none inside "
                                   "--checkpoint-root") from None
        except OSError as exc:
            raise write_refusal(exc, path, what) from exc
        try:
            ours.check(step_fd, path)
            if exists_at(step_fd, MANIFEST):
                raise Conflict(f"{what}: {str(path)!r} is a complete checkpoint (it has "
                               f"{MANIFEST}); the server never writes over one (the worker "
                               "removes the manifest before it saves a step again)")
        finally:
            os.close(step_fd)


class RunDirectories:
    """The directories below a claimed run directory the server may write into: those of
    the run's user (`run_uid`, the owner of the run directory and its owner file) and
    those of the server itself (made by it for the run). Another user's directory there
    (one moved in, or made in a run directory others may write) is refused."""

    def __init__(self, run_dir: Path, run_uid: int, what: str) -> None:
        self.run_dir, self.run_uid, self.what = run_dir, run_uid, what
        self.server_uid = os.geteuid()

    def check(self, dir_fd: int, path: Path) -> None:
        uid = os.fstat(dir_fd).st_uid
        if uid not in (self.run_uid, self.server_uid):
            raise PermissionDenied(
                f"{self.what}: checkpoint directory {str(path)!r} belongs to uid {uid}, "
                f"neither to the run's user (uid {self.run_uid}, the owner of its run "
                f"directory {str(self.run_dir)!r}) nor to this server (uid "
                f"{self.server_uid}); the server writes only into the run's own directories")

    def open_below(self, run_fd: int, parts: Sequence[str]) -> int:
        """The descriptor of run_dir/parts[0]/.../parts[-1], each created when missing,
        opened without links and checked (`check`); the caller closes it."""
        fd = os.dup(run_fd)
        path = self.run_dir
        try:
            for part in parts:
                inner = open_dir(fd, part, create=True)
                os.close(fd)
                fd = inner
                path = path / part
                self.check(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd
