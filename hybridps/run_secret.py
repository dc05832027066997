"""A run's secret and the owner file that claims a checkpoint directory for it (no torch,
no grpc).

Who is "the same job" after a restart? Partition secrets (hybridps/partition_secret.py)
live as long as one process. A run secret lives as long as the run's checkpoints: the
worker's rank 0 keeps it in the run's checkpoint directory, readable only by the run's
user, and every rank of the job gets it from rank 0:

    <checkpoint-dir>/hybridps-run.secret  mode 0600: the secret (64 hex digits)
    <checkpoint-dir>/hybridps-run.owner   mode 0644: {"format": "hybridps-owner-v1",
                                          "run_secret_sha256": <hex>}: the claim

A rank restarted by `torchrun --max-restarts`, and a new job resuming from the
directory (another run id, another world size), read the same secret there. Register
carries it in its metadata (RUN_SECRET_HEADER); the server keeps only its sha256 with
each partition, and compares it with the owner file of a directory before it writes a
checkpoint into it or restores one from it, and before it lets a Register take over a
partition that has state (ps/core/partition_auth.py). Writing the owner file is what claims
the directory: only a user who may write there can, so the server never writes into a
directory its client could not. The claim counts only when the directory and its owner
file are of one user: in a directory anybody may add files to (a shared root, mode
1777) an owner file proves no right to the directories of others in it. The owner file
holds a digest, not the secret, so a server of another user can read it.
docs/deploy.md, "Run secrets", has the rules.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from pathlib import Path

from hybridps.safe_files import DIR_FLAGS, create_exclusive, read_file_at

log = logging.getLogger("hybridps.run_secret")

SECRET_FILE = "hybridps-run.secret"
OWNER_FILE = "hybridps-run.owner"
OWNER_FORMAT = "hybridps-owner-v1"
MAX_OWNER_BYTES = 4096
SECRET_HEX_CHARS = 64  # 256 bits


class RunClaimError(ValueError):
    """A checkpoint directory this run cannot use as its own; the message says why."""


def new_secret() -> str:
    return secrets.token_hex(SECRET_HEX_CHARS // 2)


def secret_digest(secret: str) -> str:
    """The sha256 (hex) a server keeps of a run secret; '' for none."""
    return hashlib.sha256(secret.encode()).hexdigest() if secret else ""


def digests_match(a: str, b: str) -> bool:
    """Two non-empty digests are equal (constant time)."""
    return bool(a) and bool(b) and hmac.compare_digest(a.encode(), b.encode())


def owner_bytes(digest: str) -> bytes:
    return (json.dumps({"format": OWNER_FORMAT, "run_secret_sha256": digest},
                       sort_keys=True) + "\n").encode()


def parse_owner(data: bytes, where: str) -> str:
    """The digest an owner file holds; RunClaimError naming `where` when malformed."""
    try:
        body = json.loads(data.decode())
        digest = body["run_secret_sha256"]
        ok = body.get("format") == OWNER_FORMAT and isinstance(digest, str) and \
            len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok, digest = False, ""
    if not ok:
        raise RunClaimError(f"{where} is not a {OWNER_FORMAT} owner file")
    return str(digest)


def _read_at(directory: Path, name: str, limit: int) -> bytes | None:
    fd = os.open(directory, DIR_FLAGS)
    try:
        return read_file_at(fd, name, limit)
    finally:
        os.close(fd)


def read_secret(directory: str | os.PathLike[str]) -> str | None:
    """The run secret kept in `directory` (None when it has none); RunClaimError when the
    file cannot be used (a link, unreadable, malformed)."""
    path = Path(directory)
    try:
        data = _read_at(path, SECRET_FILE, 1024)
    except FileNotFoundError:  # the directory itself
        return None
    except OSError as exc:
        raise RunClaimError(f"cannot read the run secret {path / SECRET_FILE}: "
                            f"{exc.strerror or exc}") from None
    if data is None:
        return None
    text = data.decode(errors="replace").strip()
    if len(text) != SECRET_HEX_CHARS or any(c not in "0123456789abcdef" for c in text):
        raise RunClaimError(f"{path / SECRET_FILE} does not hold a run secret "
                            f"({SECRET_HEX_CHARS} hex digits)")
    _warn_if_readable_by_others(path / SECRET_FILE)
    return text


def read_owner(directory: str | os.PathLike[str]) -> str | None:
    """The digest of the owner file of `directory` (None when there is none)."""
    path = Path(directory)
    try:
        data = _read_at(path, OWNER_FILE, MAX_OWNER_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunClaimError(f"cannot read {path / OWNER_FILE}: {exc.strerror or exc}") from None
    return None if data is None else parse_owner(data, str(path / OWNER_FILE))


def claim_directory(directory: str | os.PathLike[str], prefer: str | None = None) -> str:
    """Make `directory` (created with its parents when missing) the checkpoint directory
    of a run, and return that run's secret: the one kept there, else `prefer`, else a new
    one, written with the owner file that claims it. RunClaimError when the directory
    belongs to another run (its owner file does not match its secret) or cannot be used."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        _check_claimable(path)
        secret = read_secret(path)
        if secret is None:
            chosen = prefer or new_secret()
            claimed = read_owner(path)
            if claimed is not None and not digests_match(claimed, secret_digest(chosen)):
                raise RunClaimError(
                    f"checkpoint directory {str(path)!r} belongs to another run: its "
                    f"{OWNER_FILE} names a run secret that is not in it ({SECRET_FILE} is "
                    "missing); use another --checkpoint-dir")
            if create_exclusive(path, SECRET_FILE, (chosen + "\n").encode(), 0o600):
                secret = chosen
            else:  # another rank of the job wrote it meanwhile
                secret = read_secret(path)
                if secret is None:
                    raise RunClaimError(f"{path / SECRET_FILE} vanished while it was read")
        digest = secret_digest(secret)
        owner = read_owner(path)
        if owner is None:
            if not create_exclusive(path, OWNER_FILE, owner_bytes(digest), 0o644):
                owner = read_owner(path)
            else:
                owner = digest
    except OSError as exc:
        raise RunClaimError(f"checkpoint directory {str(path)!r} cannot be used: "
                            f"{exc.strerror or exc}") from None
    if not digests_match(owner or "", digest):
        raise RunClaimError(
            f"checkpoint directory {str(path)!r} belongs to another run: its {OWNER_FILE} "
            f"does not match the secret in its {SECRET_FILE}; use another --checkpoint-dir")
    return secret


def _check_claimable(path: Path) -> None:
    """RunClaimError, before anything is written, when the servers would take no claim
    of `path` by this user: it is another user's directory with no owner file of that
    user's in it (module doc)."""
    dir_uid = os.stat(path, follow_symlinks=False).st_uid
    try:
        owner_uid: int | None = os.stat(path / OWNER_FILE, follow_symlinks=False).st_uid
    except FileNotFoundError:
        owner_uid = None
    if owner_uid is None and dir_uid != os.geteuid():
        raise RunClaimError(
            f"checkpoint directory {str(path)!r} belongs to uid {dir_uid}, not to this "
            f"user (uid {os.geteuid()}): a run claims only a directory of its own user "
            "(the shard servers take no other claim); name a directory of your own, e.g. "
            "a new one inside it")
    if owner_uid is not None and owner_uid != dir_uid:
        raise RunClaimError(
            f"checkpoint directory {str(path)!r} belongs to uid {dir_uid} but its "
            f"{OWNER_FILE} to uid {owner_uid}, so it is claimed by no run (the shard "
            "servers would refuse it); use a directory of your own")


def _warn_if_readable_by_others(path: Path) -> None:
    try:
        mode = os.stat(path, follow_symlinks=False).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("event=run_secret_permissions path=%s mode=%o hint=\"chmod 600: whoever "
                    "reads it can take over the run's partitions\"", path, mode & 0o777)
