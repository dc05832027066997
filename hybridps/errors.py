"""Errors of the transport-free core. The servicer maps each class to one gRPC status."""

from __future__ import annotations

# The details of the UNAVAILABLE status a draining server (SIGTERM, an admin Shutdown)
# ends every Sync stream with. A client that reads them knows the server is going away
# with the optimizer state it holds: waiting --ps-timeout for it to come back cannot help
# (a restarted server has lost that state), so it stops at once.
SHUTTING_DOWN = ("server shutting down: the pushes it received are answered; the optimizer "
                 "state it holds goes with it (restart it and resume from a checkpoint)")
SHUTTING_DOWN_PREFIX = "server shutting down:"


def is_shutting_down(code: str, details: str) -> bool:
    """A status (code name, details) that says the server is draining."""
    return code == "UNAVAILABLE" and details.startswith(SHUTTING_DOWN_PREFIX)


class ShardError(Exception):
    """Base class; `reason` is the key under which refusals are counted."""

    reason = "error"


class InvalidArgument(ShardError):
    reason = "invalid_argument"


class NonFiniteGradient(InvalidArgument):
    reason = "non_finite_gradient"


class NonFiniteUpdate(InvalidArgument):
    """A push of finite gradients whose update would make m, v, the delta or the master
    rows non-finite (e.g. a gradient of 3e38, whose square overflows v): refused, with
    the state as it was."""

    reason = "non_finite_update"


class RowOutOfRange(InvalidArgument):
    reason = "row_out_of_range"


class NotFound(ShardError):
    reason = "not_found"


class NotRegistered(ShardError):
    """A push or flush for a (run, rank) that never registered."""

    reason = "not_registered"


class NotSeeded(NotRegistered):
    """A push to a master-rows partition whose fp32 master is not fully seeded yet
    (SeedRows completes what Register began, so it maps like NotRegistered)."""

    reason = "not_seeded"


class StaleIncarnation(ShardError):
    reason = "stale_incarnation"


class Conflict(ShardError):
    """A request that contradicts state the server holds (e.g. a different row range)."""

    reason = "conflict"


class OutOfOrder(ShardError):
    """A push whose step skips ahead of the next expected step."""

    reason = "out_of_order"


class FlushTimeout(ShardError):
    reason = "flush_timeout"


class AnswerEvicted(ShardError):
    """A replayed push whose step was applied, but whose saved answer is no longer held."""

    reason = "answer_evicted"


class PermissionDenied(ShardError):
    """A request for something this server never does for anyone: e.g. a checkpoint
    path that resolves outside its --checkpoint-root."""

    reason = "permission_denied"


class Unauthenticated(ShardError):
    """A call without the token its method needs, or with a wrong one (ps/edge/auth.py)."""

    reason = "unauthenticated"


class WrongSecret(ShardError):
    """A call for a partition that does not carry the secret its Register handed out."""

    reason = "wrong_secret"


class CorruptCheckpoint(ShardError):
    """A checkpoint file that does not match its manifest (size, crc32), is missing, or
    cannot be read: nothing of it is applied. The message names the file."""

    reason = "corrupt_checkpoint"


class CorruptSpill(ShardError):
    """A page of a spill file (the disk tier of a partition's state) that does not read back
    as written: the call fails, no wrong state is used. The message names file and page."""

    reason = "corrupt_spill"


class ResourceExhausted(ShardError):
    """The server cannot allocate the state a request asks for."""

    reason = "resource_exhausted"


class BadShmReference(InvalidArgument):
    """A push whose shared-memory references do not describe valid regions of its arena
    (out of bounds, misaligned, sizes not matching shape and dtype, overlapping)."""

    reason = "bad_shm_reference"


class StaleShmEpoch(ShardError):
    """A shared-memory push of an epoch the rank's arena has left: a Sync stream that
    outlived a re-Register (the rank reconnected). Retryable: the rank re-registers."""

    reason = "stale_shm_epoch"


class ShuttingDown(ShardError):
    """The server is draining (SIGTERM, an admin Shutdown): its Sync streams end with
    SHUTTING_DOWN, which a client reads as "stop now" (is_shutting_down)."""

    reason = "shutting_down"

    def __init__(self, message: str = SHUTTING_DOWN) -> None:
        super().__init__(message)


class Unimplemented(ShardError):
    """A call this server was started without (e.g. Shutdown where it cannot be stopped
    remotely)."""

    reason = "unimplemented"
