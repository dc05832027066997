"""TrainConfig: every setting of a worker run, one section per concern (torch-free).

    cfg = parse_config(TrainConfig, argv)          # flags > HYBRIDPS_* > defaults
    cfg = TrainConfig.of(local_optimizer=True, dim=8)   # in code and tests, by flag name
    cfg.sync.staleness, cfg.checkpoint.checkpoint_dir, cfg.kge.model, ...

Setting `foo_bar` of any section is the flag `--foo-bar` and the variable
`HYBRIDPS_FOO_BAR` (hybridps/cli.py; docs/flags.md lists them all, generated from these
classes). Choices are `Literal` types, checked once by `check_choices`; every other
check is in the section's __post_init__ (ValueError naming the value), or in
TrainConfig.__post_init__ when it spans sections. Parsing and checking import no torch,
so a bad flag fails at once. To add a setting: docs/flags.md ("How to add a flag").
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hybridps.cli import FlagConfig, check_settings, section, setting
from hybridps.logs import AUTO, LOG_LEVELS
from hybridps.names import describe_problem
from hybridps.optim_kinds import DENSE_OPTIMIZERS, KINDS, kind_names, kind_record
from worker.config.dense_options import DenseConfig
from worker.config.kge_options import KGEOptions
from worker.config.nodes import node_ps_address, rank_layout, split_ps
from worker.config.task_options import (
    DlrmConfig,
    FilesConfig,
    KgeConfig,
    SyntheticConfig,
    TablesConfig,
)
from worker.config.update_kinds import UpdateKind, kind_for

if TYPE_CHECKING:
    from hybridps.security import ClientSecurity

__all__ = ["SHM_MODES", "TrainConfig", "parse_host_port"]

# The built-in sparse optimizers as a type (hybridps/optim_kinds.py KINDS). --optimizer's
# choices are the registry's (a kind registered at run time too), --dense-optimizer's are
# auto and DENSE_OPTIMIZERS; the record of each kind says its dense counterpart (auto).
Optimizer: Any = Literal[KINDS]


def dense_optimizer_choices() -> tuple[str, ...]:
    return ("auto", *DENSE_OPTIMIZERS)


def _optimizer_help() -> tuple[str, str, str]:
    """From the records: the kinds for --optimizer's help, what --dense-optimizer auto picks
    where it is not the kind's own name, and the kinds that take --weight-decay."""
    records = [kind_record(k) for k in kind_names()]
    kinds = " | ".join(r.summary or r.name for r in records)
    picks = []
    for dense in DENSE_OPTIMIZERS:
        named = [r.name for r in records if r.dense == dense]
        if named and named != [dense]:
            picks.append(f"{dense} for {' and '.join(named)}")
    takes = ", ".join(r.name for r in records if r.takes_weight_decay)
    return kinds, ", ".join(picks), takes


_KINDS_HELP, _DENSE_HELP, _DECAY_HELP = _optimizer_help()
RowDtype = Literal["fp32", "bf16"]  # worker/embedding/sharded.py ROW_DTYPES maps them to torch
WireDtype = Literal["fp32", "bf16", "fp16"]  # worker/sync/client.py WIRE_DTYPES maps them to torch
Device = Literal["auto", "cpu", "cuda"]
Compensation = Literal["none", "predict"]  # worker/updates/staleness.py
PoolAt = Literal["auto", "owner", "requester"]  # worker/embedding/sharded.py POOL_AT
Sharding = Literal["row_wise", "table_wise", "auto"]  # worker/embedding/sharding.py
SameNode = Literal["auto", "off", "require"]
# The client's own same-node argument (ShardClient(shm=...)); the worker's flags reach it
# only through SameNodeConfig.client_args.
SHM_MODES = ("auto", "on", "off")
MAX_SAME_NODE_MB = 1 << 20
MIN_CHUNK_BYTES = 64 * 1024

_HOST_PORT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d+)$")


def parse_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the address."""
    match = _HOST_PORT.match(address.strip())
    if match is None:
        raise ValueError(f"ps={address!r} is not HOST:PORT (e.g. 127.0.0.1:50051 or [::1]:50051)")
    port = int(match.group("port"))
    if not 1 <= port <= 65535:
        raise ValueError(f"ps={address!r}: port {port} is outside 1..65535")
    return match.group("v6") or match.group("host"), port


def check_ps_address(address: str) -> None:
    """HOST:PORT or [V6]:PORT; ValueError if not."""
    if address.startswith("unix:"):  # a socket path: say what the server listens on
        raise ValueError(f"ps={address!r} is not HOST:PORT: the server listens on TCP only; "
                         "give its HOST:PORT (ranks on its node reach it through shared "
                         "memory, --same-node)")
    parse_host_port(address)


@dataclass(frozen=True)
class RunConfig:
    """What to train and for how long."""

    task: str = setting("synthetic", "task name (synthetic, tables, dlrm, files, kge) or "
                        "module.path:ClassName", "NAME", everyday=True)
    steps: int = setting(1000, "training steps", "N", everyday=True, at_least=1)
    epochs: int = setting(0, "passes over the data for tasks with finite data (0: use --steps)",
                          "N", everyday=True, at_least=0)
    batch_size: int = setting(256, "samples per rank per step", "B", everyday=True,
                              at_least=1)
    time_budget: float = setting(
        0.0, "minutes for the whole run: training stops in time to evaluate (the best model) "
        "and write --results, estimated from the run's own step and evaluation times "
        "(worker/train/time_budget.py); 0: no limit", "MINUTES", everyday=True, at_least=0)
    seed: int = setting(0, "seed of data, table init and dense init", "S", at_least=0)
    dim: int = setting(16, "embedding width of every table", "D", at_least=1)
    model_config: str = setting(
        "", "JSON file of the task's model options (kge: p, q; dlrm: table_rows, bottom_mlp, "
        "top_mlp)", "PATH")
    device: Device = setting("auto", "where the rows and the dense part live")
    pipeline: bool = setting(
        False, "make the next batch and exchange its ids (input dist) on a second thread "
        "while this step computes; the row lookup still waits for the staleness window (same "
        "results; measurements: docs/performance-log.md); dynamic tables: also translate the "
        "next step's raw ids to slots meanwhile, with one more step's slots pinned "
        "(docs/dynamic_ids.md)")
    pool_at: PoolAt = setting(
        "auto", "where a pooled (bag) lookup is summed: owner (each owner sums its rows' part "
        "of every bag and the B x D partial sums travel) | requester (the distinct rows "
        "travel, U x D, and are pooled where they were asked) | auto (per table, whichever "
        "moves fewer bytes on the first batch, summed over the ranks; worker/embedding/sharded.py)")
    sharding: Sharding = setting(
        "row_wise", "where each table's rows live (worker/embedding/sharding.py): row_wise "
        "(every rank an equal slice) | table_wise (each table whole on one rank, balanced "
        "over the ranks) | auto (small tables whole, large ones row-wise, by bytes and "
        "lookups); a table's own choice wins (--tables NAME:ROWS:table_wise, TableConfig); "
        "--plan prints the placement")
    group_tables: bool = setting(
        True, "hold, gather, push and update a rank's tables of one width as one group (one "
        "block with each table at a row offset, one partition table on the server); the "
        "same results as separate tables, checkpoints per table (worker/embedding/groups.py)")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.task or (":" not in self.task and not self.task.isidentifier()):
            raise ValueError(f"task={self.task!r} is not a task name or module.path:ClassName")
        if not math.isfinite(self.time_budget):
            raise ValueError(f"time_budget={self.time_budget!r} must be a finite number of "
                             "minutes (0: no limit)")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizers: sparse rows (on the shard server) and the dense part."""

    optimizer: str = setting(
        "adam", f"the rows' optimizer: {_KINDS_HELP}; docs/usage.md", choices=kind_names)
    lr: float = setting(0.02, "embedding learning rate", "LR", everyday=True, at_least=0)
    dense_lr: float = setting(3e-3, "dense (FSDP) learning rate", "LR", at_least=0)
    dense_optimizer: str = setting(
        "auto", f"the dense part's optimizer (at --dense-lr); auto: {_DENSE_HELP}, else "
        "--optimizer", choices=dense_optimizer_choices)
    weight_decay: float = setting(
        0.0, f"weight decay ({_DECAY_HELP}: decoupled on the rows; SparseAdam and sparse "
        "Adagrad have none)", "WD", at_least=0)
    init_std: float = setting(0.05, "embedding rows start as N(0, 1) * init_std", "STD",
                              at_least=0)
    row_dtype: RowDtype = setting(
        "fp32", "dtype of the embedding rows on the device (bf16: 2 bytes per element; the "
        "optimizer runs on an fp32 master copy, on the shard server or with "
        "--local-optimizer on the worker, and the rows get it rounded to bf16)")

    def __post_init__(self) -> None:
        check_settings(self)
        record = kind_record(self.optimizer)
        if not record.takes_weight_decay and self.weight_decay != 0:
            why = f": {record.no_weight_decay}" if record.no_weight_decay else ""
            raise ValueError(f"weight_decay={self.weight_decay!r} with "
                             f"optimizer={self.optimizer!r} (it takes none){why}")

    @property
    def dense_kind(self) -> str:
        """The dense part's optimizer (--dense-optimizer, auto: the kind's record's)."""
        return (kind_record(self.optimizer).dense if self.dense_optimizer == "auto"
                else self.dense_optimizer)


@dataclass(frozen=True)
class SyncConfig:
    """The shard server and the staleness window (worker/sync/client.py,
    worker/updates/source.py)."""

    ps: str = setting(
        "", "shard server of this node, HOST:PORT, or one per "
        "node A,B,... (rank r uses entry r // LOCAL_WORLD_SIZE); empty only with "
        "--local-optimizer", "HOST:PORT[,..]", everyday=True)
    local_optimizer: bool = setting(
        False, "apply the sparse optimizer in-process (no server)", everyday=True)
    staleness: int = setting(
        1, "K: before step t, every update of steps <= t-1-K is applied (0 = synchronous; "
        "with --local-optimizer K >= 1 overlaps nothing, so 0 is also the faster)",
        "K", everyday=True, at_least=0)
    staleness_compensation: Compensation = setting(
        "predict", "K >= 1: predict (weight prediction: the forward sees each row plus, once "
        "per step whose update it still misses, the row's effective update in the newest "
        "applied step; the stored rows and the pushes are unchanged; "
        "worker/updates/staleness.py) | "
        "none. No effect at K=0")
    local_memory_budget_mb: int = setting(
        0, "--local-optimizer: the host memory each rank's optimizer state, fp32 master "
        "rows and dynamic tables' paged-out rows may hold (MiB; 0: no bound); beyond it "
        "their pages spill to crc-checked files under --local-spill-dir, read back when "
        "touched (bitwise the same run; paged-out rows dropped only beyond memory and "
        "--local-spill-max-gb; worker/updates/local_spill.py)", "MB", at_least=0)
    local_spill_dir: str = setting(
        "", "--local-memory-budget-mb: where each rank spills (a directory of its own under "
        "it, removed at exit; those of dead ranks removed at start); a cache, checkpoints "
        "hold the spilled state", "DIR")
    local_spill_max_gb: float = setting(
        0.0, "--local-memory-budget-mb: the disk one rank's spill files may take (GiB; 0: no "
        "limit); a run whose files could exceed it is refused before training", "GB",
        at_least=0)
    local_spill_page_kb: int = setting(
        4, "--local-memory-budget-mb: the payload of one spill page (KiB; a fill reads the "
        "whole page of a row, as the server's --spill-page-kb)", "KB",
        at_least=1)
    ps_timeout: float = setting(
        60.0, "seconds to wait for the server (register, update, reconnect) before failing",
        "SEC")
    max_chunk_bytes: int = setting(
        4 * 1024 * 1024, "largest push message; bigger pushes are split into chunks", "BYTES",
        at_least=MIN_CHUNK_BYTES)
    wire_dtype: WireDtype = setting(
        "fp32", "dtype of gradients sent to and deltas received from the server (half the "
        "bytes; the server's math stays fp32; rounding error <= 2^-8 (bf16) or 2^-11 (fp16) "
        "relative per element, fp16 overflows beyond 65504)")
    run_id: str = setting(
        "", "run id on the server (default: TORCHELASTIC_RUN_ID, else a fresh uuid)", "ID")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.run_id:  # the server refuses other names; say so before anything starts
            problem = describe_problem("run_id", self.run_id)
            if problem is not None:
                raise ValueError(problem)
        if self.local_optimizer and self.ps:
            raise ValueError(f"ps={self.ps!r} given together with --local-optimizer: pick one")
        if self.ps:  # required: TrainConfig (not for --plan)
            for address in split_ps(self.ps):
                check_ps_address(address)
        if not math.isfinite(self.ps_timeout) or self.ps_timeout <= 0:
            raise ValueError(f"ps_timeout={self.ps_timeout!r} must be a finite number > 0")
        self._check_local_spill()

    def _check_local_spill(self) -> None:
        spill = (self.local_memory_budget_mb, self.local_spill_dir, self.local_spill_max_gb)
        if any(spill) and not self.local_optimizer:
            raise ValueError("--local-memory-budget-mb, --local-spill-dir and "
                             "--local-spill-max-gb bound --local-optimizer's state; the "
                             "shard server's are --memory-budget-mb and --spill-dir")
        if self.local_spill_dir and not self.local_memory_budget_mb:
            raise ValueError(f"local_spill_dir={self.local_spill_dir!r} without "
                             "--local-memory-budget-mb: nothing would spill")

    @property
    def update_kind(self) -> UpdateKind:
        """The run's kind of update source, chosen here once (worker/config/update_kinds.py)."""
        return kind_for(self.local_optimizer)

    @property
    def ps_address(self) -> str:
        """This rank's node's server (one --ps entry per node; see worker/config/nodes.py)."""
        return node_ps_address(self.ps, *rank_layout())


@dataclass(frozen=True)
class SameNodeConfig:
    """The same-node fast path to this node's server: a shared-memory arena in /dev/shm
    for pushes and answers, referenced by the messages of the gRPC Sync stream."""

    same_node: SameNode = setting(
        "auto", "auto: the pushes and answers in a shared-memory arena when the node's "
        "server takes it (the Sync stream carries references), else inline tensors over "
        "gRPC (another host or container) | off: inline tensors over gRPC only | require: "
        "as auto, but fail at start when the server refuses the arena")
    same_node_mb: int = setting(
        0, "size of the shared-memory arena in MiB; a push that does not fit goes inline "
        "(hold K+3 steps of pushes: 8 + 2 x dim x 4 bytes a pushed row); 0: sized from "
        "the run's pushes where the task says how many rows it pushes a step (KGE), at "
        "least 64, within the free space of /dev/shm (worker/sync/arena.py)", "MB")

    def __post_init__(self) -> None:
        if self.same_node == "stream":  # every mode streams: say so, beside the choices
            raise ValueError("same_node='stream' is not one of auto, off, require: every "
                             "mode sends the Sync messages on the gRPC stream; auto (the "
                             "default) puts the pushes and answers in a shared-memory arena "
                             "when the server takes it")
        check_settings(self)
        if not 0 <= self.same_node_mb <= MAX_SAME_NODE_MB:
            raise ValueError(f"same_node_mb={self.same_node_mb!r} must be in "
                             f"[0, {MAX_SAME_NODE_MB}] (0: sized from the run's pushes)")

    def client_args(self) -> dict[str, Any]:
        """These settings as ShardClient's keyword arguments (the one place they meet);
        shm_bytes 0: to be sized from the run's pushes (worker/arena_client.size_arena)."""
        shm = {"auto": "auto", "off": "off", "require": "on"}[self.same_node]
        return {"shm": shm, "shm_bytes": self.same_node_mb << 20}


@dataclass(frozen=True)
class SecurityConfig:
    """Token and TLS towards the shard server (docs/deploy.md; hybridps/security.py)."""

    auth_token_file: str = setting(
        "", "file with the server's shared token (else env HYBRIDPS_AUTH_TOKEN)", "PATH")
    tls: bool = setting(False, "TLS to the server (implied by --tls-ca/--tls-cert/"
                        "--tls-server-name)")
    tls_ca: str = setting(
        "", "PEM CA that signed the server's certificate (default: system roots)", "PATH")
    tls_cert: str = setting(
        "", "PEM client certificate, for servers that require one (mutual TLS)", "PATH")
    tls_key: str = setting("", "PEM private key of --tls-cert", "PATH")
    tls_server_name: str = setting(
        "", "name to verify in the server's certificate (default: the --ps host)", "NAME")

    def client_security(self) -> ClientSecurity:
        """Token + TLS material from these settings (SecurityError naming a bad file)."""
        from hybridps.security import client_security

        return client_security(token_file=self.auth_token_file, tls=self.tls,
                               ca_file=self.tls_ca, cert_file=self.tls_cert,
                               key_file=self.tls_key, server_name=self.tls_server_name)


@dataclass(frozen=True)
class CheckpointConfig:
    """Step-consistent checkpoints and resuming (worker/checkpoint/checkpointer.py)."""

    checkpoint_dir: str = setting(
        "", "write step-consistent checkpoints under DIR/step-<s>/ (shared by the ranks and "
        "the shard servers)", "DIR", everyday=True)
    checkpoint_every: int = setting(0, "checkpoint after every N steps (0: never)", "N",
                                    everyday=True, at_least=0)
    checkpoint_mode: Literal["full", "incremental"] = setting(
        "incremental", "incremental: a checkpoint writes only the rows changed since the "
        "previous one (a chain from a full one, docs/reliability.md); full: every row, "
        "every time")
    checkpoint_full_every: int = setting(
        10, "--checkpoint-mode incremental: every Nth checkpoint is a full one (1: all)", "N",
        at_least=1)
    checkpoint_keep: int = setting(
        3, "keep the newest N complete checkpoints and every older one they are composed "
        "of (an incremental one's chain), delete the others (0: keep all)", "N",
        at_least=0)
    checkpoint_on_stop: bool = setting(
        True, "on SIGTERM/SIGINT, every rank checkpoints the step they all stop after, then "
        "exits (with --checkpoint-dir; docs/operations.md: how long a stop takes)")
    checkpoint_async: bool = setting(
        True, "write a checkpoint in the background while training goes on (a snapshot of "
        "the step in host memory first; false: the step loop waits for every byte)")
    resume: bool = setting(
        False, "resume from the newest complete checkpoint under --checkpoint-dir (none: "
        "start at step 0)", everyday=True)
    resume_from: str = setting(
        "", "resume from this checkpoint (a step-<s> directory, or a root: its newest)", "PATH")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} needs --checkpoint-dir")
        if self.resume and not (self.checkpoint_dir or self.resume_from):
            raise ValueError("resume=True needs --checkpoint-dir (or --resume-from PATH)")


@dataclass(frozen=True)
class OutputConfig:
    """Logs, progress, evaluation and what is written at the end."""

    results: str = setting("", "write a JSON summary here (rank 0), and the loss plot next "
                           "to it", "PATH", everyday=True)
    log_level: str = setting(
        "auto", f"auto | {' | '.join(LOG_LEVELS)} (one `rank=R event=...` line per event). "
        "auto: on a terminal rank 0 logs INFO without the per-connection detail and the "
        "other ranks WARNING; elsewhere (a file, a pipe) every rank logs INFO", "LEVEL")
    log_every: int = setting(
        10, "steps between cross-rank loss reductions / progress updates", "N", at_least=1)
    eval_batches: int = setting(
        4, "held-out global batches per evaluation (0: none)", "N", at_least=0)
    eval_every: int = setting(
        100, "steps between evaluations (the progress bar, the plot's eval curve, "
        "--tensorboard; each costs about --eval-batches forward passes); 0: only at the end",
        "N", at_least=0)
    tensorboard: str = setting(
        "", "rank 0 writes TensorBoard scalars (loss, eval metrics, samples/s, staleness, "
        "step-time breakdown) under DIR/<run id>/ (worker/report/tensorboard.py); needs the "
        "tensorboard package: pip install 'hybridps[tensorboard]'", "DIR")
    dump_state: str = setting(
        "", "write final full tables + dense state_dict here (torch.save; for tests)", "PATH")
    progress: bool = setting(True, "tqdm progress bar on rank 0")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.log_level.upper() not in (AUTO, *LOG_LEVELS):
            raise ValueError(f"log_level={self.log_level!r} is not one of auto, "
                             f"{', '.join(LOG_LEVELS)}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(f"tensorboard={self.tensorboard!r} needs the tensorboard package, "
                             "which is not installed: pip install 'hybridps[tensorboard]'")


@dataclass(frozen=True)
class SizingConfig:
    """The memory plan checked before anything is allocated (worker/plan.py)."""

    plan: bool = setting(
        False, "print the memory/traffic plan for these flags and exit (1 if it cannot fit)")
    device_memory_gb: float = setting(
        0.0, "memory of one rank's device in GB (0: detect CUDA; checked before allocating)",
        "GB", at_least=0)
    host_memory_gb: float = setting(
        0.0, "host memory of one node in GB, for the shard server (0: detect with --plan)",
        "GB", at_least=0)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class TrainConfig(FlagConfig):
    """A worker run. Per-rank quantities say so; everything else is global."""

    sync: SyncConfig = section(SyncConfig, "shard server and staleness")
    run: RunConfig = section(RunConfig, "run")
    optim: OptimConfig = section(OptimConfig, "optimizer")
    node: SameNodeConfig = section(SameNodeConfig, "same-node fast path")
    security: SecurityConfig = section(SecurityConfig, "security (docs/deploy.md)")
    dense: DenseConfig = section(DenseConfig, "dense part (worker/dense/parallel.py)")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints")
    output: OutputConfig = section(OutputConfig, "logging and results")
    sizing: SizingConfig = section(SizingConfig, "memory plan")
    synthetic: SyntheticConfig = section(SyntheticConfig, "--task synthetic / tables")
    tables: TablesConfig = section(TablesConfig, "--task tables")
    dlrm: DlrmConfig = section(DlrmConfig, "--task dlrm")
    files: FilesConfig = section(FilesConfig, "--task files (docs/data.md)")
    kge: KgeConfig = section(KgeConfig, "--task kge")
    kge_train: KGEOptions = section(KGEOptions, "--task kge trainer (docs/kge.md)")

    def __post_init__(self) -> None:
        """The checks that span sections (each section checked its own already)."""
        if self.node.same_node == "require" and not self.sync.update_kind.needs_server:
            raise ValueError("same_node='require' needs a shard server; --local-optimizer "
                             "has none")
        if self.sync.update_kind.needs_server and not (self.sync.ps or self.sizing.plan):
            raise ValueError(
                "ps='' (empty): --ps HOST:PORT is required unless --local-optimizer")
        if self.sync.ps and self.optim.optimizer not in KINDS:
            raise ValueError(
                f"optimizer={self.optim.optimizer!r} is registered in this process only: the "
                "shard server's Register (OptimizerConfig.Kind) does not name it; use "
                "--local-optimizer")
        if self.run.task == "files" and not self.files.train_files:
            raise ValueError("task='files' needs --train-files GLOB (Parquet, Criteo .npy or "
                             "TSV files; docs/data.md)")
        if self.run.task == "kge" and not self.kge.data_dir:
            raise ValueError("task='kge' needs --data-dir DIR (train.txt, valid.txt, test.txt) "
                             "or a shipped set: --data-dir umls | kinship")

