"""ServerConfig: every setting of a shard server (torch-free, so bad flags fail at once).

Setting `foo_bar` is the flag `--foo-bar` and the variable `HYBRIDPS_FOO_BAR`
(hybridps/cli.py); docs/flags.md lists them, generated from this class. The config is
flat (ps/edge/server.py reads `config.port`, ...); `group=` gives each setting its heading in
--help and the docs. Checks live in __post_init__ (ValueError naming the value);
`ensure_checkpoint_root` and `port_file_problem` check the file system, before the server
binds.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridps.channel_options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KEEPALIVE_TIMEOUT_MS,
    SERVER_KEEPALIVE_TIME_MS,
)
from hybridps.cli import setting
from hybridps.logs import LOG_LEVELS
from hybridps.path_checks import file_problem
from ps.core.lifecycle import DEFAULT_ABORT_GRACE_S  # torch-free
from ps.core.limits import DEFAULT_RUN_SHARES  # torch-free

MIN_MESSAGE_BYTES = 4096
MAX_KERNEL_THREADS = 64  # the native pool's limit (MAX_WORKERS + the caller)
# The defaults of ps/core/shard_core.py and ps/core/partition.py (tests/worker/config/test_config.py
# checks they agree): written out here because importing those modules imports torch.
DEFAULT_FLUSH_TIMEOUT_S = 30.0
DEFAULT_ANSWER_CACHE_STEPS = 8
DEFAULT_RATE_WINDOW_S = 10.0

LISTEN = "listening"
SAME_NODE = "same-node fast path"
ENGINE = "updates and the sync protocol"
LIFECYCLE = "lifecycle"
SECURITY = "security (docs/deploy.md)"
RESOURCES = "resources and checkpoints"
LOGS = "logging"


def _s(default: Any, help: str, group: str, metavar: str | None = None, *,
       everyday: bool = False) -> Any:
    return setting(default, help, metavar, group=group, everyday=everyday)


@dataclass(frozen=True)
class ServerConfig:
    # --- listening ----------------------------------------------------------------------
    host: str = _s("127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)",
                   LISTEN, "HOST", everyday=True)
    port: int = _s(50051, "TCP port; 0 picks a free one", LISTEN, "PORT", everyday=True)
    port_file: str = _s("", "write the bound port to this file once serving (atomically)",
                        LISTEN, "PATH", everyday=True)
    reflection: bool = _s(True, "serve gRPC server reflection", LISTEN)
    keepalive_time_ms: int = _s(SERVER_KEEPALIVE_TIME_MS, "server keepalive ping interval",
                                LISTEN, "MS")
    keepalive_timeout_ms: int = _s(
        KEEPALIVE_TIMEOUT_MS, "close a connection whose keepalive ping is unanswered this long",
        LISTEN, "MS")
    # --- same-node fast path ------------------------------------------------------------
    shm: bool = _s(True, "accept the shared-memory arenas workers on this node offer at "
                   "Register (pushes and answers by reference into /dev/shm instead of inline; "
                   "false: every worker sends inline tensors)", SAME_NODE)
    shm_sweep: bool = _s(
        True, "with --shm: at start and every minute remove leaked arena files in /dev/shm "
        "(hybridps-*.arena of this user, older than a minute, that no process has open or "
        "mapped, in any container: ps/core/maintenance.py)", SAME_NODE)
    # --- updates and the sync protocol --------------------------------------------------
    max_message_bytes: int = _s(
        DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received; larger "
        "pushes/answers are chunked", ENGINE, "BYTES")
    update_threads: int = _s(0, "threads applying optimizer updates (0: min(4, cores))",
                             ENGINE, "N")
    kernel_threads: int = _s(
        0, "threads of the native row kernel within one update (0: min(8, cores))", ENGINE, "N")
    sched_batch: bool = _s(
        True, "run the server's threads under SCHED_BATCH (Linux): woken by a rank's push, "
        "the server waits for the scheduler's next decision instead of preempting the rank "
        "on its core (false: normal scheduling)", ENGINE)
    answer_cache_steps: int = _s(
        DEFAULT_ANSWER_CACHE_STEPS, "answers kept per (rank, table) to re-answer duplicate "
        "pushes", ENGINE, "N")
    flush_timeout_s: float = _s(DEFAULT_FLUSH_TIMEOUT_S,
                                "Flush timeout when the request gives none", ENGINE, "SEC")
    # --- lifecycle ----------------------------------------------------------------------
    grace_s: float = _s(5.0, "on SIGTERM/SIGINT, seconds in-flight RPCs get to finish",
                        LIFECYCLE, "SEC")
    exit_after_run: bool = _s(
        False, "stop gracefully (exit 0) once the first run is over: every rank registered "
        "here sent Finish (or one aborted and no stream of the run is left open)", LIFECYCLE)
    exit_after_run_delay_s: float = _s(
        0.0, "with --exit-after-run: keep serving this long after the run is over, then stop "
        "(docker-compose.yml: the worker container exits before the server's, so `up "
        "--exit-code-from worker` returns the job's own exit code)", LIFECYCLE, "SEC")
    run_idle_timeout_s: float = _s(
        120.0, "a run whose Sync streams all stayed closed this long without every rank "
        "finishing is abandoned: over with --exit-after-run, state 'abandoned' in the stats "
        "(0: never)", LIFECYCLE, "SEC")
    abort_grace_s: float = _s(
        DEFAULT_ABORT_GRACE_S, "a run one of whose ranks sent Finish(aborted) is over only "
        "once no rank of it has had a Sync stream open nor registered again for this long: "
        "longer than torchrun's restart time, so `torchrun --max-restarts` can bring the "
        "ranks back (they register again and the run goes on)", LIFECYCLE, "SEC")
    unused_registration_timeout_s: float = _s(
        600.0, "free a run none of whose ranks has opened a Sync stream this long after its "
        "last Register, SeedRows, Flush or Checkpoint (a client that registers and never "
        "trains holds no memory for ever; longer than a slow rank's set-up); logged "
        "`registration_expired`, and not a run's end for --exit-after-run (0: never)",
        LIFECYCLE, "SEC")
    finished_run_retention_s: float = _s(
        600.0, "free the partitions of a run this long after it is over (finished, aborted "
        "or abandoned; stats count the runs freed); `python -m ps.admin drop-run` frees one "
        "at once", LIFECYCLE, "SEC")
    # --- resources and checkpoints ------------------------------------------------------
    max_state_bytes: int = _s(
        0, "host bytes all partitions' optimizer state and master rows may hold; a Register "
        "beyond it is refused (RESOURCE_EXHAUSTED) with nothing allocated (0: 3/4 of the "
        "host's memory or cgroup limit)", RESOURCES, "BYTES")
    max_run_state_bytes: int = _s(
        0, "host bytes one run's partitions may hold on this server, within "
        "--max-state-bytes; a Register beyond it is refused (RESOURCE_EXHAUSTED) with nothing "
        "allocated (0: no limit of its own)", RESOURCES, "BYTES")
    memory_budget_mb: int = _s(
        0, "the same budget as --max-state-bytes, in MiB (give one of the two; 0 and no "
        "--max-state-bytes: 3/4 of the host's memory or cgroup limit)", RESOURCES, "MB")
    run_shares: int = _s(
        DEFAULT_RUN_SHARES, "with --max-run-state-bytes 0: a run with dynamic tables "
        "reserves budget / N at Register (its ranks' equal parts: a part's paged-out rows "
        "are dropped, seen longest ago first, beyond what its fixed state leaves of it, "
        "decided by that part's own calls only, so runs are reproducible under a budget); "
        "a Register beyond the budget is refused naming the sizes", RESOURCES, "N")
    spill_dir: str = _s(
        "", "a local directory for the disk tier: a partition whose optimizer state and "
        "master rows exceed its share of the budget keeps the share in memory as pages and "
        "the rest in crc-checked spill files here, read back when touched (bitwise the same "
        "run; a cache of this process: never a recovery source, removed with the run, and "
        "a dead server's files are removed at start). Empty: off", RESOURCES, "DIR")
    spill_max_gb: float = _s(
        0.0, "the disk the spill files may take (GiB); a Register whose spill files could "
        "exceed it is refused (RESOURCE_EXHAUSTED) naming the sizes. Set, a dynamic "
        "table's paged-out rows spill too, to its partition's equal part of it, and are "
        "dropped only beyond memory and disk (0: no limit of its own; paged-out rows are "
        "dropped beyond the memory quota)", RESOURCES, "GB")
    spill_page_kb: int = _s(
        4, "one page of a spill file's log (KiB: header, row ids, rows): evicted rows are "
        "written to disk a page at a time, and a cold row's fill reads its whole page (to "
        "check its crc32)", RESOURCES, "KB")
    checkpoint_root: str = _s(
        "checkpoints", "the directory (relative: to the server's working directory) inside "
        "which the server writes and restores checkpoints (missing: created at start when "
        "its parent directory exists; else, or when it is not a directory, the server does "
        "not start); a Checkpoint or restore naming a "
        "directory that resolves outside it (.., symbolic links) is refused "
        "(PERMISSION_DENIED). Workers' --checkpoint-dir must be inside it, created and "
        "claimed by the run (docs/deploy.md, \"Run secrets\"): the server writes only into "
        "a run's own directory, follows no link inside the root and never writes over a "
        "complete checkpoint", RESOURCES, "DIR")
    # --- security -----------------------------------------------------------------------
    auth_token_file: str = _s(
        "", "file with the shared token every RPC must carry (else env HYBRIDPS_AUTH_TOKEN; "
        "neither: no auth). Health stays open", SECURITY, "PATH")
    admin_token_file: str = _s(
        "", "file with the admin token for Shutdown and DropRun (else env "
        "HYBRIDPS_ADMIN_TOKEN; neither: both are refused)", SECURITY, "PATH")
    stats_without_token: bool = _s(False, "serve the read-only GetShardStats without a token",
                                   SECURITY)
    generate_auth_token: bool = _s(
        False, "with --auth-token-file: when that file does not exist, create it (mode 0600) "
        "holding HYBRIDPS_AUTH_TOKEN if set, else a random token; workers then read the same "
        "file (docker-compose.yml)", SECURITY)
    insecure: bool = _s(
        False, "allow listening on a non-loopback address without a token (anyone who "
        "reaches the port can then register, push and checkpoint)", SECURITY)
    tls_cert: str = _s("", "PEM certificate (chain) of this server: serve TLS (with "
                       "--tls-key)", SECURITY, "PATH")
    tls_key: str = _s("", "PEM private key of --tls-cert", SECURITY, "PATH")
    tls_client_ca: str = _s(
        "", "PEM CA bundle: require client certificates signed by it (mutual TLS)", SECURITY,
        "PATH")
    # --- logging ------------------------------------------------------------------------
    log_level: str = _s("INFO", " | ".join(LOG_LEVELS), LOGS, "LEVEL", everyday=True)
    server_id: str = _s("", "id reported to clients (default: host-pid-random)", LOGS, "ID")
    rate_window_s: float = _s(DEFAULT_RATE_WINDOW_S, "window of the rows/s statistic and of "
                              "the disk tier's fills/s and spills/s", LOGS, "SEC")
    metrics_port: int = _s(
        -1, "serve Prometheus metrics at http://HOST:PORT/metrics on the --host address "
        "(ps/edge/metrics.py; no token, no TLS): -1 off, 0 a free port (printed and logged)", LOGS,
        "PORT")

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
        for name in ("run_idle_timeout_s", "abort_grace_s", "finished_run_retention_s",
                     "exit_after_run_delay_s", "unused_registration_timeout_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 0 and finite")
        if self.max_state_bytes < 0:
            raise ValueError(f"--max-state-bytes {self.max_state_bytes} must be >= 0 "
                             "(0: derived from the host's memory)")
        if self.max_run_state_bytes < 0:
            raise ValueError(f"--max-run-state-bytes {self.max_run_state_bytes} must be >= 0 "
                             "(0: no limit of its own)")
        if self.memory_budget_mb < 0:
            raise ValueError(f"--memory-budget-mb {self.memory_budget_mb} must be >= 0 "
                             "(0: derived from the host's memory)")
        if self.memory_budget_mb and self.max_state_bytes:
            raise ValueError(f"--memory-budget-mb {self.memory_budget_mb} and "
                             f"--max-state-bytes {self.max_state_bytes} are the same budget: "
                             "give one")
        if self.run_shares < 1:
            raise ValueError(f"--run-shares {self.run_shares} must be >= 1")
        if not 0 <= self.spill_max_gb < float("inf"):
            raise ValueError(f"--spill-max-gb {self.spill_max_gb} must be >= 0 and finite "
                             "(0: no limit of its own)")
        if self.spill_page_kb < 1:
            raise ValueError(f"--spill-page-kb {self.spill_page_kb} must be >= 1")
        if self.spill_dir and os.path.exists(self.spill_dir) and \
                not os.path.isdir(self.spill_dir):
            raise ValueError(f"--spill-dir {self.spill_dir!r} is not a directory")
        if not self.checkpoint_root:
            raise ValueError("--checkpoint-root must not be empty")
        if self.generate_auth_token and not self.auth_token_file:
            raise ValueError("--generate-auth-token needs --auth-token-file (where to write it)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def state_budget_bytes(self) -> int:
        """The budget's bytes as given (0: the default, ps/core/limits.py)."""
        return self.max_state_bytes or self.memory_budget_mb * 2**20

    @property
    def log_level_number(self) -> int:
        return int(getattr(logging, self.log_level.upper()))


def spill_dir_problem(path: str) -> str | None:
    """Why the server cannot spill into --spill-dir `path` (created when missing, like the
    checkpoint root); None: it can, or spilling is off."""
    if not path:
        return None
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"--spill-dir {path!r}: cannot create it ({exc.strerror or exc})"
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return f"--spill-dir {path!r} is not a writable directory"
    return None


def port_file_problem(path: str) -> str | None:
    """None when --port-file can be written once the server serves (the file replaced, its
    missing directories made: ps/edge/server.py write_port_file); else the one line that
    says why not, before the server binds, rather than a traceback after it bound."""
    if not path:
        return None
    return file_problem("--port-file", path, example="ps.port")


def ensure_checkpoint_root(root: str) -> str | None:
    """Make --checkpoint-root an existing directory: None when it is one, or was created
    now (a missing root whose parent is a directory: `checkpoints` of a fresh working
    directory, a fresh volume's /data/checkpoints); else the one line that says why the
    server cannot start with it (it is a file, or neither it nor its parent exists)."""
    if os.path.isdir(root):
        return None
    if os.path.lexists(root):
        return (f"--checkpoint-root {root!r} is not a directory: give the directory the "
                "server writes checkpoints into")
    parent = os.path.dirname(os.path.abspath(root))
    if not os.path.isdir(parent):
        return (f"--checkpoint-root {root!r} does not exist, nor does its parent directory "
                f"{parent!r}: create it (mkdir -p) or give an existing directory")
    try:
        os.mkdir(root)
    except OSError as exc:
        return (f"--checkpoint-root {root!r} does not exist and cannot be created "
                f"({exc.strerror or exc}): create it or give an existing directory")
    return None
