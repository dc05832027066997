"""How a call proves it speaks for a partition: the per-partition secret's metadata.

Register answers a partition's secret (RegisterResponse.partition_secret); every later
call for that (run, rank) carries it in its metadata, next to the auth token (the worker
attaches both in one place: worker/sync/grpc_client.py ShardRpc.metadata). The Sync stream
also names the partition it is bound to (`hybridps-partition: <run_id>/<rank>`): the
server checks the secret when the stream opens and every push on it against that
binding. Run ids are letters, digits, `_`, `.` and `-` (hybridps/names.py), so `/`
separates unambiguously.

A Register also carries the run secret (hybridps/run_secret.py) in RUN_SECRET_HEADER: the
proof that it belongs to the job that owns the partition's state and checkpoints; a
resume from a directory of another run secret carries that one in RESTORE_SECRET_HEADER.
"""

from __future__ import annotations

from collections.abc import Sequence

SECRET_HEADER = "hybridps-partition-secret"
PARTITION_HEADER = "hybridps-partition"
RUN_SECRET_HEADER = "hybridps-run-secret"
RESTORE_SECRET_HEADER = "hybridps-restore-secret"


def partition_metadata(run_id: str, rank: int, secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata naming a partition and carrying its secret (nothing without one)."""
    if not secret:
        return ()
    return ((PARTITION_HEADER, f"{run_id}/{rank}"), (SECRET_HEADER, secret))


def run_secret_metadata(run_secret: str, restore_secret: str = ""
                        ) -> tuple[tuple[str, str], ...]:
    """The metadata of a Register carrying the run secret (and the restore's, if another)."""
    out = ((RUN_SECRET_HEADER, run_secret),) if run_secret else ()
    return out + (((RESTORE_SECRET_HEADER, restore_secret),) if restore_secret else ())


def given_run_secrets(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, str]:
    """(run secret, restore secret) a Register carries ('' each when absent)."""
    return _value(metadata, RUN_SECRET_HEADER), _value(metadata, RESTORE_SECRET_HEADER)


def _value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str:
    for k, v in metadata or ():
        if k.lower() == key:
            return v.decode("ascii", "replace") if isinstance(v, bytes) else v
    return ""


def given_secret(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The partition secret a call carries ('' when none)."""
    return _value(metadata, SECRET_HEADER)


def given_partition(metadata: Sequence[tuple[str, str | bytes]] | None
                    ) -> tuple[str, int] | None:
    """(run_id, rank) a Sync stream names; None when absent or malformed."""
    text = _value(metadata, PARTITION_HEADER)
    run_id, sep, rank = text.rpartition("/")
    if not sep or not run_id:
        return None
    try:
        return run_id, int(rank)
    except ValueError:
        return None
