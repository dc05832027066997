"""Dynamic tables (docs/dynamic_ids.md): their spec and the fixed hashes of raw ids.

Shared by the worker (the id -> slot map, admission, owners) and the shard server (the
paged-out rows' expiry): no torch.distributed, no grpc. torch is imported only by the
functions that return tensors, so parsing `--tables` stays torch-free (worker.config).

`mix64` is splitmix64's finalizer over uint64 (numpy wraps modulo 2^64 by definition,
so the values are the same on every machine). The owner of an id is `mix64(id ^ salt)
% W`: a function of the id alone, so a checkpoint re-shards by recomputing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

from hybridps.cli import ConfigError
from hybridps.native import dynamic as _native

if TYPE_CHECKING:
    import torch

Eviction = Literal["lru", "lfu"]
Admission = Literal["always", "threshold", "probability"]
EVICTIONS: tuple[str, ...] = get_args(Eviction)
ADMISSIONS: tuple[str, ...] = get_args(Admission)

_U64 = np.uint64
OWNER_SALT = 0x2545F4914F6CDD1D
INIT_SALT = 0x9E3779B97F4A7C15
SKETCH_DEPTH = 4
DEFAULT_SKETCH_WIDTH = 1 << 20


@dataclass(frozen=True)
class DynamicSpec:
    """How a dynamic table admits and evicts ids (its capacity is the table's num_rows).

    eviction: "lru" | "lfu" (ties: the least recently seen, then the lowest slot);
    admission: "always" | "threshold" (seen in `threshold` steps, counted by a count-min
    sketch of SKETCH_DEPTH x `sketch_width` counters) | "probability" (each step an unknown
    id is seen it is admitted with probability `probability`, from a hash of (seed, id,
    step)); expire_steps: a paged-out id unseen for that many steps is dropped (0: never).
    """

    eviction: str = "lru"
    admission: str = "always"
    threshold: int = 2
    probability: float = 1.0
    expire_steps: int = 0
    sketch_width: int = DEFAULT_SKETCH_WIDTH

    def __post_init__(self) -> None:
        self.check("dynamic table")

    def check(self, what: str) -> None:
        """ConfigError (a ValueError) naming the bad value: the worker reports it as one line,
        from a custom Task's tables too."""
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"{what}: unknown eviction policy {self.eviction!r} (one of "
                              f"{', '.join(EVICTIONS)})")
        if self.admission not in ADMISSIONS:
            raise ConfigError(f"{what}: unknown admission policy {self.admission!r} (one of "
                              f"{', '.join(ADMISSIONS)})")
        for name in ("threshold", "expire_steps", "sketch_width", "probability"):
            value = getattr(self, name)
            number = (int,) if name != "probability" else (int, float)
            if isinstance(value, bool) or not isinstance(value, number):
                raise ConfigError(f"{what}: {name}={value!r} is not "
                                  f"{'an int' if name != 'probability' else 'a number'}")
        if self.threshold < 1:
            raise ConfigError(f"{what}: threshold={self.threshold} must be >= 1")
        if not 0.0 < self.probability <= 1.0:
            raise ConfigError(f"{what}: probability={self.probability} must be in (0, 1]")
        if self.expire_steps < 0:
            raise ConfigError(f"{what}: expire={self.expire_steps} must be >= 0 (0: never)")
        if self.sketch_width < 1:
            raise ConfigError(f"{what}: sketch_width={self.sketch_width} must be >= 1")

    def describe(self) -> str:
        admit = {"always": "always", "threshold": f"threshold={self.threshold}",
                 "probability": f"probability={self.probability:g}"}[self.admission]
        return f"{self.eviction}, {admit}, expire={self.expire_steps}"


def check_capacity(name: str, capacity: int, world_size: int) -> None:
    """Every rank needs at least one slot."""
    if capacity < 1:
        raise ValueError(f"table {name!r}: dynamic capacity {capacity} must be >= 1")
    if capacity < world_size:
        raise ValueError(f"table {name!r}: dynamic capacity {capacity} is below the world "
                         f"size {world_size}: every rank needs at least one slot (raise the "
                         "capacity)")


def whole_on(rank: int, world_size: int, start: int, end: int, capacity: int) -> int | None:
    """The rank holding every slot of a table when rank `rank` of `world_size` holds slots
    [start, end) of `capacity` (-1: some other rank), None: spread by id hash. Only a
    table-wise placement has a rank holding all or none of them: a hashed one gives every
    rank at least one slot (check_capacity), and none all of them (world size > 1)."""
    if world_size == 1:
        return None
    if end - start == capacity:
        return rank
    return -1 if end == start else None


def as_u64(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """int64 ids (any value) as their uint64 bit patterns (a view where possible)."""
    arr = ids if isinstance(ids, np.ndarray) else ids.detach().cpu().numpy()
    return np.ascontiguousarray(arr, dtype=np.int64).view(_U64)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 values (a bijection of 64-bit values)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def salted(ids_u64: np.ndarray, salt: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(ids_u64 ^ _U64(salt % 2**64))


def owner_of_ids(ids: torch.Tensor, world_size: int, whole_on: int | None = None
                 ) -> torch.Tensor:
    """owner_N (int64): the rank owning each raw id at world size `world_size`; `whole_on`:
    the rank holding every slot of a table-wise table (worker/embedding/sharding.py), so
    every id's owner."""
    import torch
    if world_size == 1 or whole_on is not None:
        return torch.full((ids.numel(),), whole_on or 0, dtype=torch.int64)
    owners = salted(as_u64(ids.reshape(-1)), OWNER_SALT) % _U64(world_size)
    return torch.from_numpy(owners.astype(np.int64))


def unit_floats(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in (0, 1] (53 bits)."""
    return ((bits >> _U64(11)).astype(np.float64) + 1.0) * (1.0 / 2**53)


# The initial rows' generator: a sum of four 16-bit uniforms (Irwin-Hall of 4), centred
# and scaled to the std. Not Box-Muller: its log/cos/sin cost more than the rest of a new
# id's work in the owner's native step, and libm's results match numpy's only within an
# ulp; a sum of integers scaled by one float64 multiply is the same value in C and numpy
# by construction (docs/performance-log.md has the figures).
_IH_CENTRE = 2 * 0xFFFF                            # the sum's mean (four values in [0, 65535])
_IH_STD = ((65536.0 * 65536.0 - 1.0) / 3.0) ** 0.5  # the sum's std


def initial_scale(init_std: float) -> float:
    """The float64 factor that takes a centred sum of four 16-bit values to std
    `init_std` (`initial_rows`; the native loop takes it as it is)."""
    return float(init_std) / _IH_STD


def init_salt(seed: int, table_index: int) -> int:
    """The salt of a table's initial rows (`initial_rows`)."""
    return (INIT_SALT ^ (seed * 0x100000001B3) ^ (table_index << 48)) % 2**64


def initial_rows(ids: torch.Tensor, dim: int, *, seed: int, table_index: int,
                 init_std: float, native: bool | None = None) -> torch.Tensor:
    """[N, dim] float32 rows with mean 0 and std `init_std`, drawn from a hash of (seed,
    table, id, column), the same for an id whatever its slot, world size or arrival step.
    Each value is a sum of four 16-bit uniforms (a bell-shaped law bounded at 2 sqrt(3)
    std, kurtosis 2.7 against a normal's 3), centred and scaled: integer sums and one
    float64 multiply, so the C loop of hybridps/native/dynamic.c (`native`; None: where
    built) gives these values bitwise; this numpy version is its reference and fallback."""
    import torch
    u = as_u64(ids.reshape(-1))
    n = u.size
    if n == 0:
        return torch.empty(0, dim)
    salt = init_salt(seed, table_index)
    scale = initial_scale(init_std)
    if _native is not None if native is None else native:
        assert _native is not None
        out = torch.empty(n, dim)
        _native.initial_rows(u.ctypes.data, n, dim, salt, scale, out.data_ptr())
        return out
    with np.errstate(over="ignore"):
        base = salted(u, salt)
        bits = mix64(base[:, None] + np.arange(1, dim + 1, dtype=_U64)[None, :])
    mask = _U64(0xFFFF)
    total = ((bits & mask) + ((bits >> _U64(16)) & mask) + ((bits >> _U64(32)) & mask)
             + (bits >> _U64(48))).astype(np.int64)
    rows = (total - _IH_CENTRE).astype(np.float64) * scale
    return torch.from_numpy(rows.astype(np.float32))
