"""Shared-token auth for the shard server: one grpc.aio server interceptor.

Policy (checked before any servicer code runs, so a refused call changes nothing):
- grpc.health.v1.Health/*: always open (load balancers, `docker compose`
  healthchecks and `python -m ps.admin health` need no secret; it reveals only
  SERVING / NOT_SERVING).
- hybridps.v1.ShardService/* and server reflection: the worker token, when the
  server has one (--auth-token-file / HYBRIDPS_AUTH_TOKEN).
- hybridps.v1.AdminService/GetShardStats (read-only): the worker token or the
  admin token; open only when the operator passes --stats-without-token.
- hybridps.v1.AdminService/Shutdown and DropRun (change state): the admin token
  only (--admin-token-file / HYBRIDPS_ADMIN_TOKEN); PERMISSION_DENIED when the
  server has no admin token at all, so they cannot be called remotely by default.
A missing or wrong token is UNAUTHENTICATED. Tokens are compared with
hmac.compare_digest.

The interceptor also guards the decoding of every unary request: bytes that are not
the method's message are INVALID_ARGUMENT naming the method (gRPC itself would answer
UNKNOWN "Unexpected DecodeError"), and the servicer never sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from hybridps.errors import InvalidArgument, PermissionDenied, ShardError, Unauthenticated
from hybridps.logs import kv
from hybridps.security import bearer_token, token_matches
from ps.edge.status import abort_status, status_for

log = logging.getLogger("ps.auth")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
STATS_METHOD = "/hybridps.v1.AdminService/GetShardStats"
SHUTDOWN_METHOD = "/hybridps.v1.AdminService/Shutdown"
DROP_RUN_METHOD = "/hybridps.v1.AdminService/DropRun"
ADMIN_ONLY_METHODS = (SHUTDOWN_METHOD, DROP_RUN_METHOD)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


@dataclass(frozen=True)
class AuthPolicy:
    token: str = ""        # worker token ('' = shard calls open)
    admin_token: str = ""  # admin token ('' = Shutdown disabled)
    stats_without_token: bool = False

    def check(self, method: str, given: str) -> ShardError | None:
        """None when `given` may call `method`, else the error to refuse with."""
        if method.startswith(HEALTH_PREFIX):
            return None
        if method in ADMIN_ONLY_METHODS:
            if not self.admin_token:
                name = method.rsplit("/", 1)[-1]
                return PermissionDenied(
                    f"{name} is disabled: the server was started without an admin token "
                    "(--admin-token-file or HYBRIDPS_ADMIN_TOKEN)")
            if given and token_matches(given, self.admin_token):
                return None
            return Unauthenticated(_missing_or_wrong(given, "admin token"))
        if method == STATS_METHOD:
            if self.stats_without_token or not (self.token or self.admin_token):
                return None
            if given and any(token_matches(given, t) for t in (self.token, self.admin_token)
                             if t):
                return None
            return Unauthenticated(_missing_or_wrong(given, "token (auth or admin)"))
        if not self.token:
            return None
        if given and token_matches(given, self.token):
            return None
        return Unauthenticated(_missing_or_wrong(given, "auth token"))


def _missing_or_wrong(given: str, what: str) -> str:
    if not given:
        return (f"missing {what}: send metadata 'authorization: Bearer <token>' "
                "(--auth-token-file or HYBRIDPS_AUTH_TOKEN on the client)")
    return f"wrong {what}"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies an AuthPolicy to every incoming call; `on_refused(reason)` counts refusals."""

    def __init__(self, policy: AuthPolicy,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.policy = policy
        self.on_refused = on_refused

    async def intercept_service(  # type: ignore[override]  # None: unknown method
            self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        given = bearer_token(handler_call_details.invocation_metadata)  # type: ignore[arg-type]
        refusal = self.policy.check(method, given)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if refusal is None:
            return _decoding_guarded(handler, method)
        reason = "unauthenticated" if isinstance(refusal, Unauthenticated) else "denied"
        if self.on_refused is not None:
            self.on_refused(reason)
        return _refusing_handler(handler, method, refusal)


def _refusing_handler(handler: grpc.RpcMethodHandler, method: str,
                      refusal: ShardError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `refusal`'s status."""
    code, message = status_for(refusal)

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning(kv("refused", rpc=method.rsplit("/", 1)[-1], code=code.name,
                       reason="auth", peer=context.peer(), error=message))
        await abort_status(context, refusal)

    # the request is never decoded: bytes that are not the method's message are refused
    # with that status too, not answered UNKNOWN with a traceback in the log
    kwargs = {"request_deserializer": None,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class _Undecodable:
    """What a guarded deserializer gives for bytes that are not the method's message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _decoding_guarded(handler: grpc.RpcMethodHandler,
                      method: str) -> grpc.RpcMethodHandler:
    """`handler` with its request decoding guarded (unary-unary methods; module doc)."""
    if (handler.request_streaming or handler.response_streaming
            or handler.request_deserializer is None or handler.unary_unary is None):
        return handler
    decode = handler.request_deserializer
    inner: Any = handler.unary_unary
    name = method.rsplit("/", 1)[-1]

    def safe_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as exc:  # DecodeError, and whatever a custom codec raises
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            message = f"{name}: the request is not a valid {name} message ({request.error})"
            log.warning(kv("refused", rpc=name, code="INVALID_ARGUMENT", reason="undecodable",
                           peer=context.peer(), error=message))
            await abort_status(context, InvalidArgument(message))
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=safe_decode,
        response_serializer=handler.response_serializer)
