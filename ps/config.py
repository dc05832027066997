"""Shard server configuration: every field is a `--flag` and a `HYBRIDPS_FLAG` env var."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hybridps.channel_options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KEEPALIVE_TIMEOUT_MS,
    SERVER_KEEPALIVE_TIME_MS,
)
from ps.core import DEFAULT_FLUSH_TIMEOUT_S
from ps.partition import DEFAULT_ANSWER_CACHE_STEPS, DEFAULT_RATE_WINDOW_S

MIN_MESSAGE_BYTES = 4096
MAX_KERNEL_THREADS = 64  # the native pool's limit (MAX_WORKERS + the caller)
MAX_UDS_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={
        "help": "address to listen on (0.0.0.0 or :: for every interface)"})
    port: int = field(default=50051, metadata={"help": "TCP port; 0 picks a free one"})
    port_file: str = field(default="", metadata={
        "help": "write the bound port to this file once serving (atomically)"})
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata={
        "help": "largest gRPC message sent or received; larger pushes/answers are chunked"})
    update_threads: int = field(default=0, metadata={
        "help": "threads applying optimizer updates (0: min(4, cores))"})
    kernel_threads: int = field(default=0, metadata={
        "help": "threads of the native row kernel within one update (0: min(8, cores))"})
    uds: str = field(default="", metadata={
        "help": "also listen on this Unix domain socket path (workers on this node: "
                "--ps unix:PATH); a stale socket file there is replaced"})
    shm: bool = field(default=True, metadata={
        "help": "accept the shared-memory arenas workers on this node offer at Register "
                "(pushes and answers by reference into /dev/shm instead of inline; "
                "false: every worker sends inline tensors)"})
    shm_socket: bool = field(default=True, metadata={
        "help": "with --shm: offer the ranks whose arena it accepts a Unix socket next to "
                "the arenas for their Sync messages, written and read by their training "
                "thread instead of a gRPC stream (ps/direct.py; false: the Sync stream)"})
    sched_batch: bool = field(default=True, metadata={
        "help": "run the server's threads under SCHED_BATCH (Linux): woken by a rank's "
                "push, the server waits for the scheduler's next decision instead of "
                "preempting the rank on its core (false: normal scheduling)"})
    reflection: bool = field(default=True, metadata={"help": "serve gRPC server reflection"})
    log_level: str = field(default="INFO", metadata={"help": f"one of {LOG_LEVELS}"})
    answer_cache_steps: int = field(default=DEFAULT_ANSWER_CACHE_STEPS, metadata={
        "help": "answers kept per (rank, table) to re-answer duplicate pushes"})
    flush_timeout_s: float = field(default=DEFAULT_FLUSH_TIMEOUT_S, metadata={
        "help": "Flush timeout when the request gives none"})
    grace_s: float = field(default=5.0, metadata={
        "help": "on SIGTERM/SIGINT, seconds in-flight RPCs get to finish"})
    rate_window_s: float = field(default=DEFAULT_RATE_WINDOW_S, metadata={
        "help": "window of the rows/s statistic"})
    keepalive_time_ms: int = field(default=SERVER_KEEPALIVE_TIME_MS, metadata={
        "help": "server keepalive ping interval"})
    keepalive_timeout_ms: int = field(default=KEEPALIVE_TIMEOUT_MS, metadata={
        "help": "close a connection whose keepalive ping is unanswered this long"})
    server_id: str = field(default="", metadata={"help": "id reported to clients (default: "
                                                         "host-pid-random)"})
    metrics_port: int = field(default=-1, metadata={
        "help": "serve Prometheus metrics at http://HOST:PORT/metrics on the --host address "
                "(ps/metrics.py; no token, no TLS): -1 off, 0 a free port (printed and "
                "logged)"})
    # --- lifecycle ------------------------------------------------------------------
    exit_after_run: bool = field(default=False, metadata={
        "help": "stop gracefully (exit 0) once the first run is over: every rank registered "
                "here sent Finish (or one aborted and no stream of the run is left open)"})
    run_idle_timeout_s: float = field(default=120.0, metadata={
        "help": "a run whose Sync streams all stayed closed this long without every rank "
                "finishing is abandoned: over with --exit-after-run, state 'abandoned' in "
                "the stats (0: never)"})
    # --- security (docs/deploy.md) ----------------------------------------------------
    auth_token_file: str = field(default="", metadata={
        "help": "file with the shared token every RPC must carry (else env "
                "HYBRIDPS_AUTH_TOKEN; neither: no auth). Health stays open"})
    admin_token_file: str = field(default="", metadata={
        "help": "file with the admin token for Shutdown (else env HYBRIDPS_ADMIN_TOKEN; "
                "neither: Shutdown is refused)"})
    stats_without_token: bool = field(default=False, metadata={
        "help": "serve the read-only GetShardStats without a token"})
    tls_cert: str = field(default="", metadata={
        "help": "PEM certificate (chain) of this server: serve TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = field(default="", metadata={
        "help": "PEM CA bundle: require client certificates signed by it (mutual TLS)"})

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} must be in [0, 65535]")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} must be in [0, 65535] "
                             "(-1: off)")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is the gRPC --port")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"--max-message-bytes {self.max_message_bytes} must be >= "
                             f"{MIN_MESSAGE_BYTES}")
        if self.max_message_bytes > 2**31 - 1:
            raise ValueError(f"--max-message-bytes {self.max_message_bytes} must be < 2 GiB "
                             "(a gRPC limit)")
        if self.update_threads < 0:
            raise ValueError(f"--update-threads {self.update_threads} must be >= 0")
        if not 0 <= self.kernel_threads <= MAX_KERNEL_THREADS:
            raise ValueError(f"--kernel-threads {self.kernel_threads} must be in "
                             f"[0, {MAX_KERNEL_THREADS}] (0: the default)")
        if self.uds and (self.uds.startswith("unix:") or len(self.uds.encode()) > MAX_UDS_PATH):
            raise ValueError(f"--uds {self.uds!r} must be a plain file path (no unix: prefix) "
                             f"of at most {MAX_UDS_PATH} bytes")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r} must be one of {LOG_LEVELS}")
        if self.answer_cache_steps < 1:
            raise ValueError(f"--answer-cache-steps {self.answer_cache_steps} must be >= 1")
        for name in ("flush_timeout_s", "rate_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be > 0")
        if not self.grace_s >= 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")
        if self.keepalive_time_ms <= 0 or self.keepalive_timeout_ms <= 0:
            raise ValueError("--keepalive-time-ms and --keepalive-timeout-ms must be > 0")
        if not self.run_idle_timeout_s >= 0:
            raise ValueError(f"--run-idle-timeout-s {self.run_idle_timeout_s} must be >= 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def log_level_number(self) -> int:
        return int(getattr(logging, self.log_level.upper()))
