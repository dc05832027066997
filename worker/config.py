"""TrainConfig: every knob of a worker run, one flag and one env var per field.

Field `foo_bar` is the flag `--foo-bar` and the environment variable
`HYBRIDPS_FOO_BAR` (see hybridps/cli.py; flag > env > default). Validation
raises ValueError naming the offending value; the CLI turns it into a usage
error and a non-zero exit before torch is even imported (this module must
stay torch-free so that bad flags fail fast).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from worker.dense_options import check_dense_options
from worker.kge_options import PRESETS, parse_kge_options
from worker.nodes import node_ps_address, rank_layout, split_ps

OPTIMIZERS = ("adam", "adamw", "sgd")
ROW_DTYPES = ("fp32", "bf16")
WIRE_DTYPES = ("fp32", "bf16", "fp16")  # worker/sync.py WIRE_DTYPES maps them to torch
SHM_MODES = ("auto", "on", "off")  # worker/shm.py (the one list; this module has no torch)
SHM_SOCKET_MODES = ("auto", "off")  # worker/direct.py
MAX_SHM_MB = 1 << 20
DEVICES = ("auto", "cpu", "cuda")
STALENESS_COMPENSATIONS = ("none", "predict")  # worker/staleness.py
KGE_MODELS = ("distmult", "complex", "keci", "qmult")
KGE_TRAINING = ("kvsall", "1vsall", "negsample")
MIN_CHUNK_BYTES = 64 * 1024
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

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
    """HOST:PORT, [V6]:PORT, or unix:PATH (a server's --uds on this node); ValueError if not."""
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if not path.lstrip("/") or (path.startswith("//") and not path.startswith("///")):
            raise ValueError(f"ps={address!r}: give unix:/absolute/path, unix:///absolute/path "
                             "or unix:relative/path (the server's --uds path)")
        return
    parse_host_port(address)


def parse_table_list(spec: str) -> list[tuple[str, int, int]]:
    """--tables 'NAME:ROWS[:POOL],...' -> [(name, rows, pool)]; ValueError naming the entry."""
    out: list[tuple[str, int, int]] = []
    for entry in spec.replace(" ", "").split(","):
        parts = entry.split(":")
        if (len(parts) not in (2, 3) or not parts[0].isidentifier()
                or not all(p.isdigit() for p in parts[1:])):
            raise ValueError(f"tables={spec!r}: entry {entry!r} is not NAME:ROWS[:POOL]")
        rows, pool = int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
        if rows < 1 or pool < 1:
            raise ValueError(f"tables={spec!r}: entry {entry!r} needs ROWS >= 1 and POOL >= 1")
        if parts[0] in {name for name, _, _ in out}:
            raise ValueError(f"tables={spec!r}: table {parts[0]!r} appears twice")
        out.append((parts[0], rows, pool))
    return out


def _h(text: str, metavar: str | None = None) -> dict[str, str]:
    meta = {"help": text}
    if metavar:
        meta["metavar"] = metavar
    return meta


@dataclass(frozen=True)
class TrainConfig:
    """A worker run. Per-rank quantities say so; everything else is global."""

    # --- parameter server -------------------------------------------------
    ps: str = field(default="", metadata=_h(
        "shard server of this node, HOST:PORT or unix:PATH (its --uds socket), or one per "
        "node A,B,... (rank r uses entry r // LOCAL_WORLD_SIZE); empty only with "
        "--local-optimizer", "HOST:PORT[,..]"))
    local_optimizer: bool = field(default=False, metadata=_h(
        "apply the sparse optimizer in-process (no server)", "BOOL"))
    staleness: int = field(default=1, metadata=_h(
        "K: before step t, every update of steps <= t-1-K is applied (0 = synchronous)", "K"))
    staleness_compensation: str = field(default="predict", metadata=_h(
        "K >= 1: predict (weight prediction: the forward sees each row plus, once per step "
        "whose update it still misses, the row's effective update in the newest applied "
        "step; the stored rows and the pushes are unchanged; worker/staleness.py) | none. "
        "No effect at K=0", "HOW"))
    ps_timeout: float = field(default=60.0, metadata=_h(
        "seconds to wait for the server (register, update, reconnect) before failing", "SEC"))
    max_chunk_bytes: int = field(default=4 * 1024 * 1024, metadata=_h(
        "largest push message; bigger pushes are split into chunks", "BYTES"))
    wire_dtype: str = field(default="fp32", metadata=_h(
        "dtype of gradients sent to and deltas received from the server: fp32 | bf16 | fp16 "
        "(half the bytes; the server's math stays fp32; rounding error <= 2^-8 (bf16) or "
        "2^-11 (fp16) relative per element, fp16 overflows beyond 65504)", "DTYPE"))
    shm: str = field(default="auto", metadata=_h(
        "same-node shared memory for pushes and answers (worker/shm.py): auto (offer an "
        "arena in /dev/shm at Register, fall back to inline tensors when the server "
        "cannot map it: another host or container, --shm false, an older server) | on "
        "(fail without it) | off (inline tensors over gRPC only)", "MODE"))
    shm_mb: int = field(default=64, metadata=_h(
        "size of the shared-memory arena in MiB; a push that does not fit goes inline "
        "(hold ~K+2 steps of pushes: 8 + 2 x dim x 4 bytes a pushed row)", "MB"))
    shm_socket: str = field(default="auto", metadata=_h(
        "with the arena accepted, the step's Push and Update messages over the server's "
        "Unix socket, sent and read by the training thread (worker/direct.py): auto (when "
        "the server offers one and it connects) | off (the gRPC Sync stream)", "MODE"))
    run_id: str = field(default="", metadata=_h(
        "run id on the server (default: TORCHELASTIC_RUN_ID, else a fresh uuid)", "ID"))
    # --- security / deployment (docs/deploy.md; hybridps/security.py, worker/plan.py) --
    auth_token_file: str = field(default="", metadata=_h(
        "file with the server's shared token (else env HYBRIDPS_AUTH_TOKEN)", "PATH"))
    tls: bool = field(default=False, metadata=_h(
        "TLS to the server (implied by --tls-ca/--tls-cert/--tls-server-name)", "BOOL"))
    tls_ca: str = field(default="", metadata=_h(
        "PEM CA that signed the server's certificate (default: system roots)", "PATH"))
    tls_cert: str = field(default="", metadata=_h(
        "PEM client certificate, for servers that require one (mutual TLS)", "PATH"))
    tls_key: str = field(default="", metadata=_h("PEM private key of --tls-cert", "PATH"))
    tls_server_name: str = field(default="", metadata=_h(
        "name to verify in the server's certificate (default: the --ps host)", "NAME"))
    log_level: str = field(default="INFO", metadata=_h(
        "DEBUG | INFO | WARNING | ERROR (one `rank=R event=...` line per event)", "LEVEL"))
    plan: bool = field(default=False, metadata=_h(
        "print the memory/traffic plan for these flags and exit (1 if it cannot fit)", "BOOL"))
    device_memory_gb: float = field(default=0.0, metadata=_h(
        "memory of one rank's device in GB (0: detect CUDA; checked before allocating)", "GB"))
    host_memory_gb: float = field(default=0.0, metadata=_h(
        "host memory of one node in GB, for the shard server (0: detect with --plan)", "GB"))
    # --- job ----------------------------------------------------------------
    task: str = field(default="synthetic", metadata=_h(
        "task name (synthetic) or module.path:ClassName", "NAME"))
    steps: int = field(default=1000, metadata=_h("training steps", "N"))
    epochs: int = field(default=0, metadata=_h(
        "passes over the data for tasks with finite data (0: use --steps)", "N"))
    batch_size: int = field(default=256, metadata=_h("samples per rank per step", "B"))
    seed: int = field(default=0, metadata=_h("seed of data, table init and dense init", "S"))
    # --- optimization -------------------------------------------------------
    optimizer: str = field(default="adam", metadata=_h(
        "adam (SparseAdam rows + Adam dense) | adamw | sgd", "KIND"))
    lr: float = field(default=0.02, metadata=_h("embedding learning rate", "LR"))
    dense_lr: float = field(default=3e-3, metadata=_h("dense (FSDP) learning rate", "LR"))
    weight_decay: float = field(default=0.0, metadata=_h(
        "weight decay (adamw/sgd only; SparseAdam has none)", "WD"))
    init_std: float = field(default=0.05, metadata=_h(
        "embedding rows start as N(0, 1) * init_std", "STD"))
    row_dtype: str = field(default="fp32", metadata=_h(
        "dtype of the embedding rows on the device: fp32 | bf16 (bf16: 2 bytes per element; "
        "the optimizer runs on an fp32 master copy, on the shard server or with "
        "--local-optimizer on the worker, and the rows get it rounded to bf16)", "DTYPE"))
    # --- dense part (worker/parallel.py; checks in worker/dense_options.py) -----
    dense_parallel: str = field(default="fsdp", metadata=_h(
        "fsdp (FSDP2 over all ranks) | hsdp (replicate across nodes, shard within) | ddp",
        "KIND"))
    reshard_after_forward: bool = field(default=True, metadata=_h(
        "fsdp/hsdp: free the gathered dense parameters of each unit after forward (the "
        "root's are kept for backward, which would gather them again at once)", "BOOL"))
    prefetch_dense: bool = field(default=False, metadata=_h(
        "fsdp/hsdp: start the all-gather of the dense root's parameters at the top of each "
        "step (async), so it runs during the staleness window, the batch and the embedding "
        "exchange instead of at the dense forward (no net gain measured on 2 CPU cores)",
        "BOOL"))
    dense_cpu_offload: bool = field(default=False, metadata=_h(
        "fsdp/hsdp: sharded dense params, grads, optimizer step on CPU (CPUOffloadPolicy)",
        "BOOL"))
    precision: str = field(default="fp32", metadata=_h(
        "fsdp/hsdp dense compute dtype: fp32 | bf16 | fp16 (fp16: with a GradScaler)", "P"))
    reduce_dtype: str = field(default="", metadata=_h(
        "fsdp/hsdp gradient reduce dtype: fp32 | bf16 | fp16 (empty: fp32)", "P"))
    loss_scale_init: float = field(default=2.0**16, metadata=_h(
        "--precision fp16: initial loss scale of the GradScaler", "S"))
    hsdp_shard_size: int = field(default=0, metadata=_h(
        "hsdp: ranks per shard group (0: LOCAL_WORLD_SIZE, one node)", "N"))
    ddp_bucket_mb: float = field(default=25.0, metadata=_h(
        "ddp: gradient bucket size (bucket_cap_mb)", "MB"))
    ddp_static_graph: bool = field(default=False, metadata=_h("ddp: static_graph", "BOOL"))
    ddp_find_unused_parameters: bool = field(default=False, metadata=_h(
        "ddp: find_unused_parameters", "BOOL"))
    ddp_grad_reduce: str = field(default="mean", metadata=_h(
        "ddp: mean (gradient of the global mean loss) | sum (of the sum over ranks of each "
        "rank's mean loss, i.e. world_size x; embedding gradients follow)", "HOW"))
    compile: bool = field(default=False, metadata=_h(
        "torch.compile the dense part (the embedding all_to_all stays eager)", "BOOL"))
    clip_grad_norm: float = field(default=0.0, metadata=_h(
        "clip the dense part's total gradient norm (over the full parameters) to X (0: off)",
        "X"))
    # --- synthetic job sizes ------------------------------------------------
    num_rows: int = field(default=1_000_000, metadata=_h(
        "rows of the biggest synthetic table (user); the others scale from it", "R"))
    dim: int = field(default=16, metadata=_h("embedding width of every table", "D"))
    tables: str = field(default="", metadata=_h(
        "--task tables: NAME:ROWS[:POOL],... (POOL ids per sample, mean-pooled; default 1); "
        "empty: one table t0 of --num-rows rows", "SPEC"))
    zipf_rows: int = field(default=0, metadata=_h(
        "--task tables: draw ids from the Zipf law over the first N popularity ranks only "
        "(0: over the whole table), still scattered over the whole table; the rows a step "
        "touches are then the same for any table size (bench_train.py's growth runs)", "N"))
    # --- real workloads: --task kge | dlrm (worker/tasks/kge.py, dlrm.py) --------
    data_dir: str = field(default="", metadata=_h(
        "kge: dataset directory with train.txt (+ valid.txt, test.txt)", "DIR"))
    model: str = field(default="distmult", metadata=_h(
        "kge: scoring model, one of " + " | ".join(KGE_MODELS), "NAME"))
    training: str = field(default="kvsall", metadata=_h(
        "kge: kvsall (each (h, r) vs all entities, multi-hot) | 1vsall (each (h, r, t) vs all "
        "entities) | negsample; scoring against all entities is sharded by entity rows",
        "MODE"))
    kge: str = field(default="", metadata=_h(
        "kge trainer options key=value,... (loss, reg, dropout, lr schedule, evaluation, "
        "early stopping: worker/kge_options.py KGEOptions, docs/kge.md)", "OPTS"))
    preset: str = field(default="", metadata=_h(
        "a recipe: defaults for the flags not given, e.g. fb15k237-complex (docs/kge.md)",
        "NAME"))
    neg_ratio: int = field(default=8, metadata=_h(
        "kge --training negsample: corrupted tails per positive triple", "N"))
    data_path: str = field(default="", metadata=_h(
        "dlrm: Criteo TSV file or directory (empty: the synthetic generator)", "PATH"))
    table_rows: str = field(default="", metadata=_h(
        "dlrm: rows per categorical table: one int for all 26, or 26 comma-separated", "R[,R..]"))
    model_config: str = field(default="", metadata=_h(
        "JSON file of task model options (kge: p, q; dlrm: table_rows, bottom_mlp, top_mlp)",
        "PATH"))
    # --- runtime / output ---------------------------------------------------
    device: str = field(default="auto", metadata=_h("auto | cpu | cuda", "DEV"))
    log_every: int = field(default=10, metadata=_h(
        "steps between cross-rank loss reductions / progress updates", "N"))
    eval_batches: int = field(default=4, metadata=_h(
        "held-out global batches evaluated at the end (0: none)", "N"))
    eval_every: int = field(default=0, metadata=_h(
        "steps between evaluations shown in the progress bar (0: only at the end)", "N"))
    results: str = field(default="", metadata=_h("write a JSON summary here (rank 0)", "PATH"))
    dump_state: str = field(default="", metadata=_h(
        "write final full tables + dense state_dict here (torch.save; for tests)", "PATH"))
    progress: bool = field(default=True, metadata=_h("tqdm progress bar on rank 0", "BOOL"))
    pipeline: bool = field(default=False, metadata=_h(
        "make the next batch and exchange its ids (input dist) on a second thread while this "
        "step computes; the row lookup still waits for the staleness window (same results). "
        "Off by default: on 2 CPU ranks it only paid off on a loaded machine", "BOOL"))
    # --- checkpoints (worker/checkpoint.py) -----------------------------------
    checkpoint_dir: str = field(default="", metadata=_h(
        "write step-consistent checkpoints under DIR/step-<s>/ (shared by the ranks and the "
        "shard servers)", "DIR"))
    checkpoint_every: int = field(default=0, metadata=_h(
        "checkpoint after every N steps (0: never)", "N"))
    checkpoint_keep: int = field(default=0, metadata=_h(
        "keep the newest N complete checkpoints, delete older ones (0: keep all)", "N"))
    resume: bool = field(default=False, metadata=_h(
        "resume from the newest complete checkpoint under --checkpoint-dir (none: start at "
        "step 0)", "BOOL"))
    resume_from: str = field(default="", metadata=_h(
        "resume from this checkpoint (a step-<s> directory, or a root: its newest)", "PATH"))

    def __post_init__(self) -> None:
        if self.local_optimizer and self.ps:
            raise ValueError(f"ps={self.ps!r} given together with --local-optimizer: pick one")
        if not self.local_optimizer:
            if not self.ps:
                raise ValueError(
                    "ps='' (empty): --ps HOST:PORT is required unless --local-optimizer")
            for address in split_ps(self.ps):
                check_ps_address(address)
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        for name in ("device_memory_gb", "host_memory_gb"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be finite and >= 0 (0: detect)")
        self._at_least("staleness", self.staleness, 0)
        if self.staleness_compensation not in STALENESS_COMPENSATIONS:
            raise ValueError(f"staleness_compensation={self.staleness_compensation!r} is not "
                             f"one of {', '.join(STALENESS_COMPENSATIONS)}")
        self._at_least("steps", self.steps, 1)
        self._at_least("epochs", self.epochs, 0)
        self._at_least("batch_size", self.batch_size, 1)
        self._at_least("seed", self.seed, 0)
        self._at_least("num_rows", self.num_rows, 1)
        self._at_least("dim", self.dim, 1)
        self._at_least("zipf_rows", self.zipf_rows, 0)
        self._at_least("log_every", self.log_every, 1)
        self._at_least("eval_batches", self.eval_batches, 0)
        self._at_least("checkpoint_every", self.checkpoint_every, 0)
        self._at_least("checkpoint_keep", self.checkpoint_keep, 0)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} needs --checkpoint-dir")
        if self.resume and not (self.checkpoint_dir or self.resume_from):
            raise ValueError("resume=True needs --checkpoint-dir (or --resume-from PATH)")
        self._at_least("eval_every", self.eval_every, 0)
        self._at_least("neg_ratio", self.neg_ratio, 1)
        if self.model.lower() not in KGE_MODELS:
            raise ValueError(f"model={self.model!r} is not one of {', '.join(KGE_MODELS)}")
        if self.training not in KGE_TRAINING:
            raise ValueError(
                f"training={self.training!r} is not one of {', '.join(KGE_TRAINING)}")
        parse_kge_options(self.kge)  # ValueError naming the bad key or value
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is not one of {', '.join(sorted(PRESETS))}")
        if self.table_rows and not re.fullmatch(r"\d+(,\d+)*", self.table_rows.replace(" ", "")):
            raise ValueError(f"table_rows={self.table_rows!r} is not an int or a comma list")
        if self.tables:
            parse_table_list(self.tables)
        if self.task == "kge" and not self.data_dir:
            raise ValueError("task='kge' needs --data-dir DIR (train.txt, valid.txt, test.txt)")
        self._at_least("max_chunk_bytes", self.max_chunk_bytes, MIN_CHUNK_BYTES)
        for name in ("lr", "dense_lr", "weight_decay", "init_std"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be finite and >= 0")
        if not math.isfinite(self.ps_timeout) or self.ps_timeout <= 0:
            raise ValueError(f"ps_timeout={self.ps_timeout!r} must be a finite number > 0")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.optimizer == "adam" and self.weight_decay != 0:
            raise ValueError(
                f"weight_decay={self.weight_decay!r} with optimizer='adam': SparseAdam has "
                "no weight decay, use --optimizer adamw")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} is not one of "
                             f"{', '.join(WIRE_DTYPES)}")
        if self.shm not in SHM_MODES:
            raise ValueError(f"shm={self.shm!r} is not one of {', '.join(SHM_MODES)}")
        if self.shm_socket not in SHM_SOCKET_MODES:
            raise ValueError(f"shm_socket={self.shm_socket!r} is not one of "
                             f"{', '.join(SHM_SOCKET_MODES)}")
        if not 1 <= self.shm_mb <= MAX_SHM_MB:
            raise ValueError(f"shm_mb={self.shm_mb!r} must be in [1, {MAX_SHM_MB}]")
        if self.shm == "on" and self.local_optimizer:
            raise ValueError("shm='on' needs a shard server; --local-optimizer has none")
        if self.row_dtype not in ROW_DTYPES:
            raise ValueError(f"row_dtype={self.row_dtype!r} is not one of {', '.join(ROW_DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        if not self.task or (":" not in self.task and not self.task.isidentifier()):
            raise ValueError(f"task={self.task!r} is not a task name or module.path:ClassName")
        check_dense_options(self)

    @staticmethod
    def _at_least(name: str, value: int, low: int) -> None:
        if value < low:
            raise ValueError(f"{name}={value!r} must be >= {low}")

    @property
    def ps_address(self) -> str:
        """This rank's node's server (one --ps entry per node; see worker/nodes.py)."""
        return node_ps_address(self.ps, *rank_layout())
