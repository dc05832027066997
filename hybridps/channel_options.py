"""gRPC channel/server options shared by the shard server, the admin CLI and workers.

No torch, no grpc import: just the option lists, so every side of a connection
uses the same message limits and compatible keepalive settings.

Keepalive contract: clients ping every CLIENT_KEEPALIVE_TIME_MS when idle; the
server accepts pings no more often than SERVER_MIN_PING_INTERVAL_MS (which
must stay below the client interval, or the server answers GOAWAY
"too_many_pings").
"""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CLIENT_KEEPALIVE_TIME_MS = 20_000
SERVER_KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = 10_000
SERVER_MAX_PING_STRIKES = 2

Options = list[tuple[str, int | str]]

# Pushes and answers are MiB-sized messages. With gRPC's defaults a stream's HTTP/2 flow
# control window starts at 64 KiB and grows by BDP probing, and TCP is read in small
# chunks; on loopback (bench/bench_wire.py's echo) a large fixed window and large read
# chunks gave ~1.6x the bytes/s of the defaults at 1-16 MiB messages. The window bounds
# the bytes in flight per stream (the server stops reading a stream SYNC_READ_AHEAD
# pushes ahead of the one it applies, so the window is what flow control holds back).
STREAM_WINDOW_BYTES = 64 * 1024 * 1024
BULK_TRANSFER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.experimental.tcp_read_chunk_size", 4 * 1024 * 1024),
    ("grpc.experimental.tcp_min_read_chunk_size", 1024 * 1024),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 * 1024 * 1024),
]


def _common_options(max_message_bytes: int, keepalive_time_ms: int,
                    keepalive_timeout_ms: int) -> Options:
    """Message limits and keepalive, set explicitly and alike on both sides."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # 0: keep pinging an idle connection
        *BULK_TRANSFER_OPTIONS,
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                    keepalive_time_ms: int = CLIENT_KEEPALIVE_TIME_MS,
                    keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> Options:
    """Options for a client channel to a shard server.

    Use as `grpc.aio.insecure_channel(address, options=channel_options())`
    (or with grpc.insecure_channel).
    """
    if keepalive_time_ms < SERVER_MIN_PING_INTERVAL_MS:
        raise ValueError(
            f"keepalive_time_ms={keepalive_time_ms} is below the server's minimum ping "
            f"interval {SERVER_MIN_PING_INTERVAL_MS} ms; the server would drop the connection"
        )
    return _common_options(max_message_bytes, keepalive_time_ms, keepalive_timeout_ms)


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                   keepalive_time_ms: int = SERVER_KEEPALIVE_TIME_MS,
                   keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> Options:
    """Options for the shard server (`grpc.aio.server(options=...)`)."""
    return [
        *_common_options(max_message_bytes, keepalive_time_ms, keepalive_timeout_ms),
        # Smallest interval between client pings (without data) the server tolerates.
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", SERVER_MAX_PING_STRIKES),
        # Refuse a port another process already listens on, instead of sharing it.
        ("grpc.so_reuseport", 0),
    ]
