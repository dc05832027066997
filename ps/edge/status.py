"""The one mapping from the core's exceptions to gRPC status codes, for every servicer and
the auth interceptor: no other module of ps/core or ps/edge names a status code."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import grpc

from hybridps import wire
from hybridps.errors import (
    AnswerEvicted,
    Conflict,
    CorruptCheckpoint,
    CorruptSpill,
    FlushTimeout,
    InvalidArgument,
    NotFound,
    NotRegistered,
    OutOfOrder,
    PermissionDenied,
    ResourceExhausted,
    ShardError,
    ShuttingDown,
    StaleIncarnation,
    StaleShmEpoch,
    Unauthenticated,
    Unimplemented,
    WrongSecret,
)
from ps.core.store import kv

log = logging.getLogger("ps.service")

__all__ = ["Abortable", "abort_status", "abort_with", "refusal_reason", "status_for"]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details an exception ends a call with."""
    code: grpc.StatusCode
    if isinstance(exc, (InvalidArgument, wire.WireError)):  # incl. NonFinite, RowOutOfRange
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, NotFound):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, (NotRegistered, StaleIncarnation, Conflict, OutOfOrder,
                          AnswerEvicted)):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, FlushTimeout):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    elif isinstance(exc, StaleShmEpoch):
        code = grpc.StatusCode.ABORTED
    elif isinstance(exc, ResourceExhausted):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif isinstance(exc, (PermissionDenied, WrongSecret)):
        code = grpc.StatusCode.PERMISSION_DENIED
    elif isinstance(exc, Unauthenticated):
        code = grpc.StatusCode.UNAUTHENTICATED
    elif isinstance(exc, ShuttingDown):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(exc, Unimplemented):
        code = grpc.StatusCode.UNIMPLEMENTED
    elif isinstance(exc, (CorruptCheckpoint, CorruptSpill)):
        code = grpc.StatusCode.DATA_LOSS
    else:
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    return code, str(exc)


def refusal_reason(exc: BaseException) -> str:
    """The name a refusal is counted under (ServerStats.refusals)."""
    if isinstance(exc, ShardError):
        return exc.reason
    if isinstance(exc, wire.WireError):
        return "wire_error"
    return "internal"


class Abortable(Protocol):
    """What abort_with needs of a call (grpc.aio.ServicerContext)."""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> Any: ...


async def abort_status(context: Abortable, exc: BaseException) -> None:
    """End the call with the mapped status, unlogged (raises AbortError)."""
    await context.abort(*status_for(exc))


async def abort_with(context: Abortable, rpc: str, exc: BaseException,
                     **fields: Any) -> None:
    """Log the failure and end the call with the mapped status (raises AbortError)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error(kv("internal_error", rpc=rpc, error=message, **fields), exc_info=exc)
    else:
        log.warning(kv("refused", rpc=rpc, code=code.name, reason=refusal_reason(exc),
                       error=message, **fields))
    await context.abort(code, message)
