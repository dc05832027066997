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

OPTIMIZERS = ("adam", "adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
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
        "shard server of this node, HOST:PORT (empty only with --local-optimizer)", "HOST:PORT"))
    local_optimizer: bool = field(default=False, metadata=_h(
        "apply the sparse optimizer in-process (no server)", "BOOL"))
    staleness: int = field(default=1, metadata=_h(
        "K: before step t, every update of steps <= t-1-K is applied (0 = synchronous)", "K"))
    ps_timeout: float = field(default=60.0, metadata=_h(
        "seconds to wait for the server (register, update, reconnect) before failing", "SEC"))
    max_chunk_bytes: int = field(default=4 * 1024 * 1024, metadata=_h(
        "largest push message; bigger pushes are split into chunks", "BYTES"))
    run_id: str = field(default="", metadata=_h(
        "run id on the server (default: TORCHELASTIC_RUN_ID, else a fresh uuid)", "ID"))
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
    # --- synthetic job sizes ------------------------------------------------
    num_rows: int = field(default=1_000_000, metadata=_h(
        "rows of the biggest synthetic table (user); the others scale from it", "R"))
    dim: int = field(default=16, metadata=_h("embedding width of every table", "D"))
    # --- runtime / output ---------------------------------------------------
    device: str = field(default="auto", metadata=_h("auto | cpu | cuda", "DEV"))
    log_every: int = field(default=10, metadata=_h(
        "steps between cross-rank loss reductions / progress updates", "N"))
    eval_batches: int = field(default=4, metadata=_h(
        "held-out global batches evaluated at the end (0: none)", "N"))
    results: str = field(default="", metadata=_h("write a JSON summary here (rank 0)", "PATH"))
    dump_state: str = field(default="", metadata=_h(
        "write final full tables + dense state_dict here (torch.save; for tests)", "PATH"))
    progress: bool = field(default=True, metadata=_h("tqdm progress bar on rank 0", "BOOL"))

    def __post_init__(self) -> None:
        if self.local_optimizer and self.ps:
            raise ValueError(f"ps={self.ps!r} given together with --local-optimizer: pick one")
        if not self.local_optimizer:
            if not self.ps:
                raise ValueError(
                    "ps='' (empty): --ps HOST:PORT is required unless --local-optimizer")
            parse_host_port(self.ps)
        self._at_least("staleness", self.staleness, 0)
        self._at_least("steps", self.steps, 1)
        self._at_least("epochs", self.epochs, 0)
        self._at_least("batch_size", self.batch_size, 1)
        self._at_least("seed", self.seed, 0)
        self._at_least("num_rows", self.num_rows, 1)
        self._at_least("dim", self.dim, 1)
        self._at_least("log_every", self.log_every, 1)
        self._at_least("eval_batches", self.eval_batches, 0)
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
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        if not self.task or (":" not in self.task and not self.task.isidentifier()):
            raise ValueError(f"task={self.task!r} is not a task name or module.path:ClassName")

    @staticmethod
    def _at_least(name: str, value: int, low: int) -> None:
        if value < low:
            raise ValueError(f"{name}={value!r} must be >= {low}")

    @property
    def ps_address(self) -> str:
        return self.ps.strip()
