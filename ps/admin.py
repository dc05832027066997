"""`python -m ps.admin`: talk to a shard server (no torch import).

    python -m ps.admin stats --ps HOST:PORT            # one line per run: state, step, pushes
                                                       # (fits the terminal; 100 columns off one)
    python -m ps.admin stats --ps HOST:PORT --wide     # one line per (run, rank, table)
    python -m ps.admin stats --run run-1a2b --watch 2  # one run, refreshed every 2 s
    python -m ps.admin stats --json                    # the ShardStats message, numbers as numbers
    python -m ps.admin health --ps HOST:PORT      # exit 0 only when SERVING (healthchecks)
    python -m ps.admin shutdown --ps HOST:PORT    # graceful stop; needs the admin token
    python -m ps.admin drop-run --ps HOST:PORT --run RUN   # free a run now (admin token)

Every subcommand takes the TLS flags (--tls, --tls-ca, --tls-cert, --tls-key,
--tls-server-name); stats and shutdown send a token (stats: --auth-token-file or env
HYBRIDPS_AUTH_TOKEN, else the admin token; shutdown and drop-run: --admin-token-file or
HYBRIDPS_ADMIN_TOKEN).
Health is open on every server and sends no token.

The calls and the report live in hybridps/admin.py (the worker prints the stats too).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from hybridps.admin import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WIDTH,
    drop_run,
    format_shard_stats,
    get_shard_stats,
    health_status,
    select_runs,
    shutdown_server,
    stats_json,
)
from hybridps.cli import ConfigError, add_dataclass_flags, from_namespace
from hybridps.security import (
    ADMIN_TOKEN_ENV,
    AUTH_TOKEN_ENV,
    ClientSecurity,
    SecurityError,
    client_security,
)


@dataclass(frozen=True)
class ClientConfig:
    """Flags every subcommand shares: where the server is and how to reach it."""

    ps: str = field(default="127.0.0.1:50051", metadata={"help": "shard server HOST:PORT"})
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S, metadata={"help": "RPC timeout"})
    tls: bool = field(default=False, metadata={
        "help": "use TLS (implied by any --tls-* flag; system roots without --tls-ca)"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA that signed the server's cert"})
    tls_cert: str = field(default="", metadata={"help": "PEM client certificate (mutual TLS)"})
    tls_key: str = field(default="", metadata={"help": "PEM key of --tls-cert"})
    tls_server_name: str = field(default="", metadata={
        "help": "name to verify in the server's certificate (default: the --ps host)"})

    def __post_init__(self) -> None:
        if not self.ps:
            raise ValueError("--ps HOST:PORT is required")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s {self.timeout_s} must be > 0")

    def security(self, token_file: str = "", token_env: str = "") -> ClientSecurity:
        return client_security(token_file=token_file, token_env=token_env, tls=self.tls,
                               ca_file=self.tls_ca, cert_file=self.tls_cert,
                               key_file=self.tls_key, server_name=self.tls_server_name)


DEFAULT_WATCH_S = 2.0


@dataclass(frozen=True)
class StatsConfig(ClientConfig):
    json: bool = field(default=False, metadata={
        "help": "print the ShardStats message as JSON (counters as numbers; one line per "
                "refresh with --watch)"})
    wide: bool = field(default=False, metadata={
        "help": "one row per (run, rank, table) with every counter and the whole run id "
                "(default: one row per run)"})
    run: str = field(default="", metadata={
        "help": "only runs whose id starts with this (the short ids of the default view "
                "work)"})
    run_id: str = field(default="", metadata={
        "help": "only this exact run id, filtered by the server (default: every run)"})
    watch: float = field(default=0.0, metadata={
        "help": f"refresh every SEC seconds until Ctrl-C (--watch alone: {DEFAULT_WATCH_S:g}; "
                "0: print once)", "metavar": "SEC"})
    auth_token_file: str = field(default="", metadata={
        "help": "file with the token (else env HYBRIDPS_AUTH_TOKEN; without either, the "
                "admin token)"})
    admin_token_file: str = field(default="", metadata={
        "help": "file with the admin token, which reads stats too (else env "
                "HYBRIDPS_ADMIN_TOKEN; used when no auth token is given)"})

    def stats_security(self) -> ClientSecurity:
        """The auth token (--auth-token-file, else HYBRIDPS_AUTH_TOKEN), else the admin
        token (--admin-token-file, else HYBRIDPS_ADMIN_TOKEN): GetShardStats takes either
        (ps/edge/auth.py), and a server may have only the admin token."""
        security = self.security(self.auth_token_file, AUTH_TOKEN_ENV)
        if self.auth_token_file or (security.token and not self.admin_token_file):
            return security
        return self.security(self.admin_token_file, ADMIN_TOKEN_ENV)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.watch >= 0 and self.watch != float("inf")):
            raise ValueError(f"--watch {self.watch} must be a number of seconds >= 0")


@dataclass(frozen=True)
class HealthConfig(ClientConfig):
    service: str = field(default="", metadata={
        "help": "service to check ('' = the whole server)"})


@dataclass(frozen=True)
class ShutdownConfig(ClientConfig):
    admin_token_file: str = field(default="", metadata={
        "help": "file with the admin token (else env HYBRIDPS_ADMIN_TOKEN)"})
    grace_s: float = field(default=0.0, metadata={
        "help": "seconds in-flight RPCs get (0: the server's --grace-s)"})
    reason: str = field(default="", metadata={"help": "logged by the server"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.grace_s >= 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")


@dataclass(frozen=True)
class DropRunConfig(ClientConfig):
    run: str = field(default="", metadata={"help": "the run id whose partitions to free"})
    admin_token_file: str = field(default="", metadata={
        "help": "file with the admin token (else env HYBRIDPS_ADMIN_TOKEN)"})
    reason: str = field(default="", metadata={"help": "logged by the server"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.run:
            raise ValueError("--run RUN is required")


COMMANDS: dict[str, tuple[type[ClientConfig], str]] = {
    "stats": (StatsConfig, "print GetShardStats"),
    "health": (HealthConfig, "exit 0 only when the server is SERVING (for healthchecks)"),
    "shutdown": (ShutdownConfig, "graceful stop (needs the admin token)"),
    "drop-run": (DropRunConfig, "free every partition of a run now (needs the admin token)"),
}


def _rpc_failure(what: str, address: str, exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"ps.admin: {what} from {address} failed: {name}: {details}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps.admin",
                                     description="hybridps shard server admin")
    commands = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (cls, help_text) in COMMANDS.items():
        parsers[name] = commands.add_parser(name, help=help_text)
        add_dataclass_flags(parsers[name], cls)
    for action in parsers["stats"]._actions:  # `--watch` alone: the default period
        if action.dest == "watch":
            action.nargs, action.const = "?", str(DEFAULT_WATCH_S)
    ns = parser.parse_args(argv)
    cls = COMMANDS[ns.command][0]
    try:
        config = from_namespace(cls, ns)
        if isinstance(config, StatsConfig):
            security = config.stats_security()
        elif isinstance(config, (ShutdownConfig, DropRunConfig)):
            security = config.security(config.admin_token_file, ADMIN_TOKEN_ENV)
        else:
            security = config.security()
    except (ConfigError, SecurityError) as exc:
        parsers[ns.command].error(str(exc))
    try:
        if isinstance(config, StatsConfig):
            return watch_stats(config, security) if config.watch else print_stats(
                config, security)
        elif isinstance(config, HealthConfig):
            status = health_status(config.ps, config.timeout_s, config.service, security)
            print(f"{config.ps} {config.service or '(server)'}: {status}")
            return 0 if status == "SERVING" else 1
        elif isinstance(config, ShutdownConfig):
            server_id = shutdown_server(config.ps, security, config.grace_s, config.reason,
                                        config.timeout_s)
            print(f"{config.ps}: server {server_id} is stopping")
        elif isinstance(config, DropRunConfig):
            reply = drop_run(config.ps, security, config.run, config.reason, config.timeout_s)
            print(f"{config.ps}: run {config.run!r}: freed {reply.partitions_freed} "
                  f"partitions ({reply.state_bytes_freed / 2**20:.1f} MB of state)")
    except grpc.RpcError as exc:
        rpc = {"stats": "GetShardStats", "health": "Health.Check", "shutdown": "Shutdown",
               "drop-run": "DropRun"}
        print(_rpc_failure(rpc[ns.command], config.ps, exc), file=sys.stderr)
        return 1
    return 0


def print_stats(config: StatsConfig, security: ClientSecurity, indent: int | None = 2) -> int:
    every = get_shard_stats(config.ps, config.timeout_s, config.run_id, security)
    stats = select_runs(every, config.run)
    width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns  # COLUMNS, the terminal
    text = (stats_json(stats, indent) if config.json else
            format_shard_stats(stats, config.wide, [p.run_id for p in every.partitions],
                               width=width))
    print(text, flush=True)
    return 0


def watch_stats(config: StatsConfig, security: ClientSecurity) -> int:
    """Print the stats every --watch seconds until Ctrl-C (exit 0); a failed call prints
    its line and the watch goes on (the server may be restarting)."""
    clear = "\033[H\033[2J" if sys.stdout.isatty() and not config.json else ""
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        # Only remembered, never raised: a KeyboardInterrupt raised inside grpc's own code
        # (a call's condition wait, the channel's close) can leave it holding a lock the
        # exit then waits on for ever. The call under way ends by its own deadline, and
        # the loop stops.
        interrupted.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        while not interrupted.is_set():
            started = time.monotonic()
            if not config.json:
                print(f"{clear}every {config.watch:g}s  {time.strftime('%H:%M:%S')}  "
                      f"{config.ps}  (Ctrl-C stops)", flush=True)
            try:
                print_stats(config, security, indent=None)
            except grpc.RpcError as exc:
                print(_rpc_failure("GetShardStats", config.ps, exc), file=sys.stderr,
                      flush=True)
            interrupted.wait(max(0.0, config.watch - (time.monotonic() - started)))
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
