"""The native (C) row kernels against the torch reference path of hybridps.optim.

m and v must be bitwise equal; the delta may differ in the last bits only because
torch's float32 sqrt (MKL) is not always correctly rounded while the C sqrtf is, so
it is compared with a tight relative tolerance and the largest difference is printed
(pytest -s) and recorded (junit property).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import hybridps.optim as optim
import hybridps.push_checks as push_checks
import hybridps.state_alloc as state_alloc
from hybridps import native
from hybridps.optim import OptimizerSpec
from ps.core.partition import TableSpec, TableState
from worker.embedding.rows import TableConfig, init_rows
from worker.embedding.sharded import ShardedEmbedding

needs_native = pytest.mark.skipif(
    native.ext is None, reason=f"native kernels not built ({native.load_error})"
)

SPECS = {
    "adam": OptimizerSpec("adam", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8),
    "adamw": OptimizerSpec("adamw", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8,
                           weight_decay=0.1),
    "adamw_big_b1w": OptimizerSpec("adamw", lr=0.02, beta1=0.3, beta2=0.9, eps=1e-6,
                                   weight_decay=0.05),  # lerp weight >= 0.5 branch
    "sgd": OptimizerSpec("sgd", lr=0.05, weight_decay=0.01),
}
# float32: 1 ulp is 1.2e-7 relative; the delta is within a few ulps of torch's.
DELTA_RTOL, DELTA_ATOL = 1e-6, 1e-12


@pytest.fixture
def native_kernel() -> Iterator[None]:
    before = optim.kernel_info()["requested"]
    optim.set_kernel("native")
    yield
    optim.set_kernel(before)


def _state(kind: str, rows: int, dim: int, seed: int) -> tuple[torch.Tensor | None, ...]:
    if not SPECS[kind].has_moments:
        return None, None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=gen) * 0.1, torch.rand(rows, dim, generator=gen)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _compare_steps(kind: str, dim: int, n_rows: int, batch: int, threads: int,
                   record: Callable[[str, object], None], steps: int = 4) -> float:
    """Run `steps` pushes through both paths from the same state; returns max |delta diff|."""
    spec = SPECS[kind]
    m_ref, v_ref = _state(kind, n_rows, dim, seed=dim)
    m_nat, v_nat = _clone(m_ref), _clone(v_ref)
    gen = torch.Generator().manual_seed(1000 + dim)
    worst = 0.0
    for step in range(1, steps + 1):
        ids = torch.randperm(n_rows, generator=gen)[:batch]  # unique, unsorted
        grads = torch.randn(batch, dim, generator=gen)
        d_ref, k_ref = optim.apply_rows_torch_(spec, m_ref, v_ref, ids, grads.clone(), step)
        d_nat, k_nat = optim.apply_rows_(spec, m_nat, v_nat, ids, grads, step,
                                         num_threads=threads)
        assert k_nat == k_ref
        assert d_nat.shape == d_ref.shape == (batch, dim) and d_nat.dtype == torch.float32
        worst = max(worst, _max_abs(d_nat, d_ref))
        torch.testing.assert_close(d_nat, d_ref, rtol=DELTA_RTOL, atol=DELTA_ATOL)
        if spec.has_moments:
            assert m_nat is not None and v_nat is not None
            assert m_ref is not None and v_ref is not None
            if kind == "adam":  # separate torch ops: bitwise on every platform
                assert torch.equal(m_nat, m_ref) and torch.equal(v_nat, v_ref)
            else:  # bitwise where torch's kernels use FMA (AVX2/AVX-512); tight anyway
                torch.testing.assert_close(m_nat, m_ref, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(v_nat, v_ref, rtol=1e-6, atol=1e-7)
    print(f"{kind} dim={dim} batch={batch} threads={threads}: max |delta diff| = {worst:.3g}")
    record("max_abs_delta_diff", worst)
    return worst


@needs_native
@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [1, 7, 33, 64, 128])
@pytest.mark.parametrize("kind", list(SPECS))
def test_native_matches_torch_path(kind: str, dim: int, threads: int,
                                   record_property: Callable[[str, object], None]) -> None:
    # 5000 rows x dim >= 32768 elements for dim >= 7: the 2-thread case really splits.
    _compare_steps(kind, dim, n_rows=7000, batch=5000, threads=threads,
                   record=record_property, steps=3)


@needs_native
@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize("batch", [1, 3, 300])
def test_native_small_pushes(batch: int, record_property: Callable[[str, object], None]) -> None:
    for kind in SPECS:
        _compare_steps(kind, 33, n_rows=400, batch=batch, threads=2, record=record_property)


@needs_native
@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize("kind", list(SPECS))
def test_native_empty_push(kind: str) -> None:
    spec = SPECS[kind]
    m, v = _state(kind, 10, 5, seed=0)
    m0, v0 = _clone(m), _clone(v)
    ids, grads = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5)
    delta, decay = optim.apply_rows_(spec, m, v, ids, grads, 1, num_threads=2)
    ref, ref_decay = optim.apply_rows_torch_(spec, _clone(m0), _clone(v0), ids, grads, 1)
    assert delta.shape == ref.shape == (0, 5) and decay == ref_decay
    if m is not None:
        assert m0 is not None and v0 is not None and v is not None
        assert torch.equal(m, m0) and torch.equal(v, v0)
    out = torch.empty(4)
    delta, _ = optim.apply_rows_(spec, m, v, ids, grads, 1, out=out)
    assert delta.shape == (0, 5)


@needs_native
@pytest.mark.usefixtures("native_kernel")
def test_native_matches_sparse_adam_state(record_property: Callable[[str, object], None]
                                          ) -> None:
    """Against torch.optim.SparseAdam itself: its exp_avg/exp_avg_sq bitwise, weights close."""
    rows, dim = 3000, 33
    torch.manual_seed(0)
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    weights = emb.weight.detach().clone()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-7)
    spec = OptimizerSpec("adam", lr=0.01, beta1=0.8, beta2=0.95, eps=1e-7)
    m, v = torch.zeros(rows, dim), torch.zeros(rows, dim)
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for step in range(1, 11):
        idx = torch.randint(0, rows, (4000,), generator=gen)  # repeats: coalescing sums
        opt.zero_grad()
        emb(idx).pow(2).sum().backward()
        grad = emb.weight.grad
        assert grad is not None
        grad = grad.coalesce()
        opt.step()
        delta, decay = optim.apply_rows_(spec, m, v, grad.indices()[0], grad.values(), step,
                                         num_threads=2)
        optim.apply_update_(weights, grad.indices()[0], delta, decay, num_threads=2)
        worst = max(worst, _max_abs(weights, emb.weight.detach()))
    state = opt.state[emb.weight]
    assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
    torch.testing.assert_close(weights, emb.weight.detach(), rtol=1e-6, atol=1e-7)
    print(f"SparseAdam, 10 steps: max |weight diff| = {worst:.3g}")
    record_property("max_abs_weight_diff", worst)


@needs_native
@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("dim", [7, 64])
def test_native_apply_update_is_bitwise(dim: int, decay: float, threads: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    rows = torch.randn(9000, dim, generator=gen)
    ref = rows.clone()
    ids = torch.randperm(9000, generator=gen)[:6000]
    delta = torch.randn(6000, dim, generator=gen) * 1e-3
    optim.apply_update_(rows, ids, delta, decay, num_threads=threads)
    optim.apply_update_torch_(ref, ids, delta, decay)
    assert torch.equal(rows, ref)
    # int32 ids and a float64 delta are converted, as on the torch path
    optim.apply_update_(rows, ids.to(torch.int32), delta.double(), decay)
    optim.apply_update_torch_(ref, ids, delta, decay)
    assert torch.equal(rows, ref)


@needs_native
@pytest.mark.usefixtures("native_kernel")
def test_native_reuses_the_out_buffer() -> None:
    spec = SPECS["adam"]
    m, v = torch.zeros(100, 8), torch.zeros(100, 8)
    m2, v2 = m.clone(), v.clone()
    out = torch.full((64, 8), float("nan"))
    for step, n in enumerate((50, 10, 64), start=1):
        ids, grads = torch.randperm(100)[:n], torch.randn(n, 8)
        delta, _ = optim.apply_rows_(spec, m, v, ids, grads, step, out=out)
        assert delta.data_ptr() == out.data_ptr() and delta.shape == (n, 8)
        ref, _ = optim.apply_rows_(spec, m2, v2, ids, grads, step)
        assert torch.equal(delta, ref)
    with pytest.raises(ValueError, match="at least 65x8"):
        optim.apply_rows_(spec, m, v, torch.arange(65), torch.randn(65, 8), 4, out=out)
    with pytest.raises(ValueError, match="overlap"):
        g = torch.randn(10, 8)
        optim.apply_rows_(spec, m, v, torch.arange(10), g, 4, out=g)


@needs_native
@pytest.mark.usefixtures("native_kernel")
def test_native_rejects_out_of_range_rows_before_writing() -> None:
    m, v = torch.zeros(10, 4), torch.zeros(10, 4)
    with pytest.raises(IndexError, match="row id 10 at position 2 is out of range"):
        optim.apply_rows_(SPECS["adam"], m, v, torch.tensor([0, 3, 10]), torch.ones(3, 4), 1)
    with pytest.raises(IndexError, match="row id -1"):
        optim.apply_rows_(SPECS["adamw"], m, v, torch.tensor([-1]), torch.ones(1, 4), 1)
    with pytest.raises(IndexError):
        optim.apply_update_(m, torch.tensor([11]), torch.ones(1, 4), 1.0)
    assert not m.any() and not v.any()


@needs_native
@pytest.mark.usefixtures("native_kernel")
def test_native_ineligible_tensors_use_the_torch_path() -> None:
    """float64 state or strided gradients are not for the C loops: same results anyway."""
    spec = SPECS["adam"]
    m, v = torch.zeros(20, 6, dtype=torch.float64), torch.zeros(20, 6, dtype=torch.float64)
    ids, grads = torch.tensor([1, 5, 7]), torch.randn(3, 6, dtype=torch.float64)
    delta, _ = optim.apply_rows_(spec, m, v, ids, grads, 1)
    assert delta.dtype == torch.float64
    m32, v32 = torch.zeros(20, 6), torch.zeros(20, 6)
    strided = torch.randn(6, 3).t()
    delta, _ = optim.apply_rows_(spec, m32, v32, ids, strided, 1)
    ref, _ = optim.apply_rows_torch_(spec, torch.zeros(20, 6), torch.zeros(20, 6), ids,
                                     strided, 1)
    assert torch.equal(delta, ref)


def _scan_cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """(case, ids, grads, lo, hi): clean, bad ids, unsorted, repeats, non-finite values."""
    gen = torch.Generator().manual_seed(7)
    for n, dim in ((0, 4), (1, 4), (7, 3), (300, 16), (5000, 2)):
        ids = torch.randperm(10_000, generator=gen)[:n].sort().values + 100
        grads = torch.randn(n, dim, generator=gen)
        yield f"clean n={n}", ids, grads, 100, 10_100
        if n == 0:
            continue
        yield f"shuffled n={n}", ids[torch.randperm(n, generator=gen)], grads, 100, 10_100
        for pos in sorted({0, n // 2, n - 1}):
            for bad in (99, 10_100, -1, 2**63 - 1):
                wrong = ids.clone()
                wrong[pos] = bad
                if n > 2:  # a second bad id later: the first position is reported
                    wrong[-1] = -5
                yield f"bad id {bad} at {pos} n={n}", wrong, grads, 100, 10_100
            if n > 1:
                repeat = ids.clone()
                repeat[pos] = ids[pos - 1] if pos else ids[1]
                yield f"repeat at {pos} n={n}", repeat, grads, 100, 10_100
            for value in (float("nan"), float("inf"), float("-inf")):
                wrong_g = grads.clone()
                wrong_g.view(-1)[(pos * dim + dim // 2)] = value
                if grads.numel() > 3:
                    wrong_g.view(-1)[-1] = float("nan")
                yield f"{value} at row {pos} n={n}", ids, wrong_g, 100, 10_100
    huge = torch.full((3, 2), 3e38)  # finite, but its sum overflows: the exact check
    yield "finite but overflowing sum", torch.tensor([1, 2, 3]), huge, 0, 10


@needs_native
def test_scan_push_native_equals_torch() -> None:
    """The server's push checks: the C scan gives the torch path's answer in every case."""
    cases = list(_scan_cases())
    assert len(cases) > 80
    for case, ids, grads, lo, hi in cases:
        ref = push_checks._scan_push_torch(ids, grads, lo, hi)
        got = native.ext.scan_push(ids.data_ptr(), ids.shape[0], lo, hi, grads.data_ptr(),
                                   grads.numel())
        assert got == ref, case
        assert push_checks.scan_push(ids, grads, lo, hi) == ref, case  # the dispatch


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_mark_rows_counts_fresh_rows(kernel: str) -> None:
    if kernel == "native" and native.ext is None:
        pytest.skip(f"native kernels not built ({native.load_error})")
    before = optim.kernel_info()["requested"]
    optim.set_kernel(kernel)
    try:
        flags = torch.zeros(50, dtype=torch.bool)
        assert push_checks.mark_rows_(flags, torch.tensor([3, 9, 4], dtype=torch.int64)) == 3
        assert push_checks.mark_rows_(flags, torch.tensor([9, 10], dtype=torch.int64)) == 1
        assert push_checks.mark_rows_(flags, torch.tensor([], dtype=torch.int64)) == 0
        assert flags.nonzero().view(-1).tolist() == [3, 4, 9, 10]
        with pytest.raises(IndexError):
            push_checks.mark_rows_(flags, torch.tensor([2, 50], dtype=torch.int64))
        assert flags.nonzero().view(-1).tolist() == [3, 4, 9, 10]  # nothing marked
    finally:
        optim.set_kernel(before)


@needs_native
@pytest.mark.usefixtures("native_kernel")
def test_native_concurrent_callers() -> None:
    """Two threads (as the server's update pool does): one runs on the pool, one inline."""
    spec, dim, rows = SPECS["adam"], 64, 20000
    ids = [torch.randperm(rows, generator=torch.Generator().manual_seed(s))[:8000]
           for s in range(2)]
    grads = [torch.randn(8000, dim) for _ in range(2)]
    states = [(torch.zeros(rows, dim), torch.zeros(rows, dim)) for _ in range(2)]
    refs = [(torch.zeros(rows, dim), torch.zeros(rows, dim)) for _ in range(2)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for step in range(1, 31):
                optim.apply_rows_(spec, *states[i], ids[i], grads[i], step, num_threads=2)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        for step in range(1, 31):
            optim.apply_rows_torch_(spec, *refs[i], ids[i], grads[i], step)
        assert torch.equal(states[i][0], refs[i][0]) and torch.equal(states[i][1], refs[i][1])


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.usefixtures("native_kernel")
def test_native_pool_works_after_fork() -> None:
    spec, m, v = SPECS["adam"], torch.zeros(9000, 64), torch.zeros(9000, 64)
    ids, grads = torch.randperm(9000)[:6000], torch.randn(6000, 64)
    optim.apply_rows_(spec, m, v, ids, grads, 1, num_threads=2)  # starts the pool
    pid = os.fork()
    if pid == 0:  # child: the pool threads are gone; the kernel must not wait for them
        code = 1
        try:
            optim.apply_rows_(spec, m, v, ids, grads, 2, num_threads=2)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# -- choosing the kernel (these run without the extension too) ---------------------------

def _kernel_in_subprocess(env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(optim.KERNEL_ENV, None)
    if env_value is not None:
        env[optim.KERNEL_ENV] = env_value
    return subprocess.run(
        [sys.executable, "-c", "import hybridps.optim as o; print(o.kernel_name())"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.e2e
def test_env_torch_forces_the_fallback() -> None:
    proc = _kernel_in_subprocess("torch")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch"


def test_auto_picks_native_when_built() -> None:
    before = optim.kernel_info()["requested"]
    try:
        assert optim.set_kernel("auto") == ("native" if native.ext is not None else "torch")
    finally:
        optim.set_kernel(before)


@pytest.mark.e2e
def test_env_rejects_unknown_kernel() -> None:
    proc = _kernel_in_subprocess("fastest")
    assert proc.returncode != 0 and "must be one of" in proc.stderr


def test_set_kernel_torch_never_calls_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    before = optim.kernel_info()["requested"]
    try:
        assert optim.set_kernel("torch") == "torch" == optim.kernel_name()
        if native.ext is not None:
            def boom(*args: object) -> None:
                raise AssertionError("native kernel called with HYBRIDPS_KERNEL=torch")

            for name in ("adam", "adamw", "scale", "apply_update", "scan_push", "mark_rows"):
                monkeypatch.setattr(native.ext, name, boom)
        m, v = torch.zeros(10, 4), torch.zeros(10, 4)
        for spec in SPECS.values():
            delta, decay = optim.apply_rows_(spec, m, v, torch.tensor([1, 2]),
                                             torch.ones(2, 4), 1)
            optim.apply_update_(m, torch.tensor([1, 2]), delta, decay)
        ids = torch.tensor([1, 2])
        assert push_checks.scan_push(ids, torch.ones(2, 4), 0, 10) == (-1, True, -1)
        assert push_checks.mark_rows_(torch.zeros(10, dtype=torch.bool), ids) == 2
    finally:
        monkeypatch.undo()
        optim.set_kernel(before)


def test_native_required_but_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    before = optim.kernel_info()["requested"]
    monkeypatch.setattr(native, "ext", None)
    monkeypatch.setattr(native, "load_error", "ImportError: not built")
    try:
        with pytest.raises(RuntimeError, match=r"not available .*not built"):
            optim.set_kernel("native")
        assert optim.set_kernel("auto") == "torch"
    finally:
        monkeypatch.undo()
        optim.set_kernel(before)


@pytest.mark.parametrize("hugepages", [True, False])
def test_alloc_state_is_zeroed_float32(hugepages: bool) -> None:
    t = state_alloc.alloc_state(3 << 16, 16, hugepages=hugepages)  # 12 MiB: advised when built
    assert t.shape == (3 << 16, 16) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    assert state_alloc.alloc_state(0, 8).shape == (0, 8)


@pytest.mark.parametrize("offset", [0, 1024, 2048])
def test_alloc_state_places_the_table_at_its_offset(offset: int, tmp_path: Path) -> None:
    """Past a 2 MiB boundary by `offset`, storage exactly the table (a save adds no slack)."""
    rows, dim = 3 << 16, 16
    t = state_alloc.alloc_state(rows, dim, offset=offset)
    assert t.data_ptr() % state_alloc.HUGEPAGE_BYTES == offset
    assert t.untyped_storage().nbytes() == rows * dim * 4 and not t.any()
    t[-1] = 7.0  # the last row is writable and the table is its own storage
    torch.save(t, tmp_path / "t.pt")
    assert (tmp_path / "t.pt").stat().st_size < rows * dim * 4 + 4096
    assert torch.equal(torch.load(tmp_path / "t.pt"), t)


@pytest.mark.parametrize("offset", [-64, 32, 4096])
def test_alloc_state_refuses_a_bad_offset(offset: int) -> None:
    with pytest.raises(ValueError, match=f"offset {offset} must be"):
        state_alloc.alloc_state(8, 8, offset=offset)


def test_server_state_tables_never_share_l1_sets() -> None:
    """m[id], v[id] (and the master row) at different offsets within a 4 KiB page."""
    spec = TableSpec(name="t", num_rows=1 << 17, dim=16, row_start=0, row_end=1 << 17)
    state = TableState("r", spec, OptimizerSpec("adam", lr=0.1), 4, 10.0, time.monotonic,
                       row_dtype=torch.bfloat16)
    assert state.m is not None and state.v is not None and state.master is not None
    pages = {t.data_ptr() % 4096 for t in (state.m, state.v, state.master)}
    assert len(pages) == 3


def test_cpu_rank_rows_are_allocated_like_server_state() -> None:
    """A CPU rank's large table sits at its own offset past 2 MiB (huge pages when
    built), its storage is exactly the table, and its rows are the seeded init rows."""
    rows, dim = 1 << 17, 16  # 8 MiB: above HUGEPAGE_MIN_BYTES
    emb = ShardedEmbedding([TableConfig("big", rows, dim), TableConfig("small", 100, dim)],
                           seed=3, init_std=0.5)
    big = emb.weights["big"].data
    assert big.data_ptr() % state_alloc.HUGEPAGE_BYTES == state_alloc.STATE_OFFSETS["rows"]
    assert big.untyped_storage().nbytes() == rows * dim * 4
    # the values do not depend on where they are stored: chunk by chunk, seeded per chunk
    assert torch.equal(big[:5], init_rows(rows, dim, 0, 5, seed=3, table_index=0,
                                          init_std=0.5))
    assert torch.isfinite(big).all() and 0.45 < big.std().item() < 0.55
    assert emb.weights["small"].shape == (100, dim)
    assert len(set(state_alloc.STATE_OFFSETS.values())) == len(state_alloc.STATE_OFFSETS)
