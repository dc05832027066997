"""What carries a rank's Sync messages: the `SyncTransport` interface and its errors.

One implementation: the gRPC Sync stream (worker/sync/grpc_client.py), on the same node
(its pushes and answers by reference into the shared-memory arena) and across nodes
(inline). ShardClient (worker/sync/client.py) calls a transport from the training thread
only; what a transport does inside (the gRPC stream's event loop) is its own business,
and tests can stand in for it behind this interface.

Failures are `TransportError`s named by gRPC status code. `TransportRetryable`: worth
re-registering and re-sending (the connection broke, the server restarted or drains);
`TransportRefused`: the server refused what we sent or who we are, and sending it
again would be refused again; `TransportShutdown`: the server said it is shutting down
(hybridps/errors.py SHUTTING_DOWN), taking the optimizer state with it, so neither a
retry nor waiting for it helps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hybridps import wire
from hybridps.errors import is_shutting_down
from hybridps.v1 import shard_pb2
from worker.sync.messages import Outgoing

# Status codes after which a broken connection is worth re-registering and re-sending.
RETRYABLE_CODES = frozenset({"UNAVAILABLE", "UNKNOWN", "INTERNAL", "ABORTED", "CANCELLED",
                             "DEADLINE_EXCEEDED"})

Response = wire.Framed[shard_pb2.SyncResponse]


class TransportError(Exception):
    """A call or a Sync transport failed: `code` is the gRPC status code's name,
    `details` the server's (or the transport's) words."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details

    @property
    def text(self) -> str:
        return f"{self.code}: {self.details}"


class TransportRetryable(TransportError):
    """Re-register, reconnect and re-send: nothing that was sent is lost."""


class TransportRefused(TransportError):
    """The server refused: retrying would be refused again."""


class TransportShutdown(TransportError):
    """The server is shutting down (it said so): its state goes with it."""


def transport_error(code: str, details: str) -> TransportError:
    """The retryable, refused or shutting-down error of a status."""
    if is_shutting_down(code, details):
        return TransportShutdown(code, details)
    kind = TransportRetryable if code in RETRYABLE_CODES else TransportRefused
    return kind(code, details)


class SyncTransport(ABC):
    """One connection of the Sync stream: requests out, responses back, in order.

    Owned by one thread (the training thread). `send` never waits for an answer;
    `receive` returns the responses that arrived, waiting up to `wait_s` for the first
    one (an empty list when none came in time). A broken connection raises a
    TransportError from either, after the responses that arrived before it.
    """

    name: str  # "stream", for the stats and the log

    @abstractmethod
    def send(self, messages: Sequence[Outgoing]) -> None:
        """SyncRequests, in order: serialized, or inline pushes the transport serializes
        (once: worker/sync/messages.py InlinePush)."""

    @abstractmethod
    def receive(self, wait_s: float) -> list[Response]:
        """The decoded SyncResponses that arrived (Framed.error set for one that did not
        decode)."""

    @abstractmethod
    def close(self) -> None:
        """Half-close, let the server end, release; safe to call twice."""

    def cut(self) -> None:
        """Break the connection at once, both ways (fault injection: HYBRIDPS_FAULT_CUT);
        the next send or receive raises a retryable TransportError."""
        raise NotImplementedError(f"the {self.name} transport cannot be cut")


def decode_response(data: bytes) -> Response:
    return wire.decode_framed(shard_pb2.SyncResponse, data,
                              (("update", "chunk", "ids"), ("update", "chunk", "delta")),
                              "update")
