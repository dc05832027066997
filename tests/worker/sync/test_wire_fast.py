"""The fast Sync path: the copy-free codec, --wire-dtype, and their flags.

Error bounds of --wire-dtype (stated in worker/config/train_config.py's help and the README):
- per element, a round trip through the wire dtype is round-to-nearest: relative error
  <= 2^-8 for bf16 (8 significant bits) and <= 2^-11 for fp16 (11 bits) inside fp16's
  normal range [2^-14, 65504] (below it fp16 is subnormal: absolute error <= 2^-25);
- end to end, the server's math is fp32 on the rounded gradients and the delta is rounded
  once more, so it is within that bound (relative) of the fp32 math on the rounded
  gradients;
- against fp32 on the wire, over 20 sparse-Adam steps of gradients whose rows range over
  two decades of magnitude, every delta element is within 1% of lr with bf16 (measured
  0.4%) and 3% with fp16 (measured 2%): fp16 gradients below 2^-14 are subnormal and lose
  relative precision, which Adam's normalization turns into a full-size step error, so
  bf16 is the recommended half-size wire dtype.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from hybridps import wire
from hybridps.cli import parse_config
from hybridps.optim import OptimizerSpec, apply_rows_torch_
from hybridps.v1 import shard_pb2
from ps.config import ServerConfig
from tests.testing.helpers import start_ps_server
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig
from worker.sync.client import WIRE_DTYPES, RowUpdate, ShardClient
from worker.sync.messages import PUSH_GRADS, PUSH_IDS

SPEC = OptimizerSpec("adam", lr=1e-2)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]


# -- the codec ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 5), (0, 5), (3,), (0,), ()])
def test_framed_round_trip_and_generated_code_agree(dtype: torch.dtype,
                                                    shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 100).to(dtype)
    ids = torch.arange(3)
    head = shard_pb2.SyncRequest(push=shard_pb2.Push(
        run_id="r", rank=1, step=9, table="t", chunk=shard_pb2.InlineChunk(index=0, count=1)))
    data = wire.encode_framed(head, [(PUSH_IDS, ids), (PUSH_GRADS, t)])
    # The generated code reads it as an ordinary SyncRequest ...
    msg = shard_pb2.SyncRequest.FromString(data).push
    assert (msg.run_id, msg.rank, msg.step, msg.table, msg.chunk.count) == ("r", 1, 9, "t", 1)
    assert torch.equal(wire.decode(msg.chunk.grads), t)
    assert torch.equal(wire.decode(msg.chunk.ids), ids)
    # ... and the framed decoder gives views of the received bytes, 8-byte aligned.
    framed = wire.decode_framed(shard_pb2.SyncRequest, data, (PUSH_IDS, PUSH_GRADS))
    assert framed.error is None
    got = framed.tensor("grads", "push")
    assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)
    assert framed.message.push.step == 9 and framed.message.push.chunk.count == 1
    assert not framed.message.push.chunk.HasField("grads")
    if t.numel():
        base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        assert base <= got.data_ptr() < base + len(data), "not a view of the message"
        assert got.data_ptr() % wire.ALIGN == 0


def test_framed_decoder_reads_what_the_generated_code_wrote() -> None:
    msg = shard_pb2.SyncResponse(update=shard_pb2.Update(
        step=3, table="t", decay=0.5, chunk=shard_pb2.InlineAnswer(index=1, count=2)))
    wire.encode(torch.arange(5), msg.update.chunk.ids)
    wire.encode(torch.randn(5, 3), msg.update.chunk.delta)
    framed = wire.decode_framed(shard_pb2.SyncResponse, msg.SerializeToString(),
                                (("update", "chunk", "ids"), ("update", "chunk", "delta")))
    assert framed.error is None and framed.message.update.decay == 0.5
    assert framed.message.update.chunk.index == 1
    assert torch.equal(framed.tensor("delta", "u"), wire.decode(msg.update.chunk.delta))
    assert framed.tensor("delta", "u").data_ptr() % 4 == 0  # copied if misaligned


def test_framed_decoder_reports_bad_messages_without_raising() -> None:
    head = shard_pb2.SyncRequest(push=shard_pb2.Push(run_id="r", step=1, table="t"))
    good = wire.encode_framed(head, [(PUSH_IDS, torch.arange(4)),
                                     (PUSH_GRADS, torch.zeros(4, 2))])
    truncated = wire.decode_framed(shard_pb2.SyncRequest, good[:40], (PUSH_IDS, PUSH_GRADS),
                                   "push")
    assert truncated.error is not None and "push" in str(truncated.error)
    with pytest.raises(wire.WireError):
        truncated.tensor("grads", "push")
    bad = shard_pb2.SyncRequest(push=shard_pb2.Push(run_id="r", step=1, table="t"))
    grads = bad.push.chunk.grads
    grads.dtype, grads.data = shard_pb2.FLOAT32, b"123"  # type: ignore[assignment]
    grads.shape[:] = [1]
    framed = wire.decode_framed(shard_pb2.SyncRequest, bad.SerializeToString(),
                                (PUSH_IDS, PUSH_GRADS), "push")
    assert "3 bytes do not match shape [1] of FLOAT32" in str(framed.error)
    assert "step=1" in str(framed.error)
    junk = wire.decode_framed(shard_pb2.SyncRequest, b"\xff\xff\xff", (PUSH_IDS, PUSH_GRADS),
                              "push")
    assert junk.error is not None


# -- --wire-dtype error bounds -----------------------------------------------------------

ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff, eps / 2
VS_FP32 = {"bf16": 0.01, "fp16": 0.03}  # max |delta - fp32-wire delta| / lr, see the top


@pytest.mark.parametrize(("dtype", "rel"), list(ROUNDING.items()))
def test_wire_dtype_round_trip_error_bound(dtype: torch.dtype, rel: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g) * 10 ** torch.empty(4096, 1).uniform_(-4, 2,
                                                                                 generator=g)
    head = shard_pb2.InlineChunk(index=0, count=1)  # a message with Tensor fields of its own
    data = wire.encode_framed(head, [("grads", x.to(dtype))])
    back = wire.decode_framed(shard_pb2.InlineChunk, data, ("grads",)).tensor("grads", "p")
    back = back.float()
    err = (back - x).abs()
    if dtype == torch.float16:
        normal = x.abs() >= 2.0**-14
        assert bool((err[normal] <= rel * x.abs()[normal]).all())
        assert bool((err[~normal] <= 2.0**-25).all())
    else:
        assert bool((err <= rel * x.abs()).all())
    assert float((err / x.abs().clamp_min(1e-30)).max()) > rel / 8  # it does round


def _reference_deltas(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int,
                      dim: int, wire_dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 sparse Adam on the gradients as the server receives them."""
    m, v = torch.zeros(rows, dim), torch.zeros(rows, dim)
    out = []
    for t, (i, g) in enumerate(zip(ids, grads, strict=True), start=1):
        delta, _ = apply_rows_torch_(SPEC, m, v, i, g.to(wire_dtype).float(), t)
        out.append(delta)
    return out


def _client(address: str, rows: int, dim: int, **kwargs: object) -> ShardClient:
    kwargs.setdefault("shm_bytes", 8 << 20)  # see tests/conftest.py HYBRIDPS_SAME_NODE_MB
    return ShardClient(address, run_id=f"wire-{os.urandom(4).hex()}", rank=0, world_size=1,
                       tables=[TableConfig("t", rows, dim)], ranges={"t": (0, rows)},
                       optimizer=SPEC, timeout_s=60.0, max_chunk_bytes=64 * 1024,
                       **kwargs)  # type: ignore[arg-type]


def _steps(rows: int, dim: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randperm(rows, generator=g)[: rows // 2].sort().values for _ in range(n)]
    grads = [torch.randn(len(i), dim, generator=g)
             * 10 ** torch.empty(len(i), 1).uniform_(-2, 0, generator=g) for i in ids]
    return ids, grads


def _push_all(client: ShardClient, ids: list[torch.Tensor],
              grads: list[torch.Tensor]) -> list[RowUpdate]:
    """Start `client`, push step i = (ids[i], grads[i]) of table "t", take every update."""
    client.start()
    try:
        for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
            client.push(step, {"t": (i, g)})
        updates, _ = client.take(len(ids) - 1)
    finally:
        client.close()
    return updates


def _run(client: ShardClient, ids: list[torch.Tensor],
         grads: list[torch.Tensor]) -> list[torch.Tensor]:
    updates = _push_all(client, ids, grads)
    assert [u.step for u in updates] == list(range(len(ids)))
    for u, i in zip(updates, ids, strict=True):
        assert torch.equal(u.ids_U, i) and u.delta_UD.dtype == torch.float32
    return [u.delta_UD for u in updates]


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_wire_dtype_end_to_end_error_bound(ps_address: str, name: str) -> None:
    """Chunked pushes (64 KiB messages) in bf16/fp16 through a real server."""
    rows, dim, n = 2000, 32, 20
    ids, grads = _steps(rows, dim, n)
    dtype = WIRE_DTYPES[name]
    got = _run(_client(ps_address, rows, dim, wire_dtype=dtype), ids, grads)
    exact = _run(_client(ps_address, rows, dim), ids, grads)  # fp32 on the wire
    for d, ref, full in zip(got, _reference_deltas(grads, ids, rows, dim, dtype), exact,
                            strict=True):
        # fp32 math on the rounded gradients, the delta rounded once (+ native-kernel ulps).
        tiny = 2.0**-25 if dtype == torch.float16 else 0.0  # fp16 subnormals: absolute
        assert bool(((d - ref).abs() <= ROUNDING[dtype] * ref.abs() + tiny + 1e-9).all())
        # Against fp32 on the wire: within 1% (bf16) / 3% (fp16) of lr.
        assert float((d - full).abs().max()) <= VS_FP32[name] * SPEC.lr
    for d, ref in zip(exact, _reference_deltas(grads, ids, rows, dim, torch.float32),
                      strict=True):
        torch.testing.assert_close(d, ref, rtol=1e-5, atol=1e-9)


# -- --wire-dtype over whole runs ---------------------------------------------------------

@pytest.mark.e2e
def test_server_logs_its_kernel(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--kernel-threads", "2")
    try:
        rows, dim = 500, 8
        ids, grads = _steps(rows, dim, 3)
        got = _run(_client(server.address, rows, dim), ids, grads)
        for d, ref in zip(got, _reference_deltas(grads, ids, rows, dim, torch.float32),
                          strict=True):
            torch.testing.assert_close(d, ref, rtol=1e-5, atol=1e-9)
        assert server.terminate() == 0
        err = server.stderr()
        assert "kernel_threads=2" in err
        # Which row kernel runs is logged at start-up.
        assert "event=kernel kernel=native" in err or "event=kernel kernel=torch" in err
    finally:
        server.terminate()


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_worker_run_with_wire_dtype(ps_address: str, tmp_path: Path, wire_dtype: str) -> None:
    """2 ranks (torchrun) at --staleness 0 with inline tensors: with fp32 on the wire the
    run equals the single-process reference; with bf16 the rows stay close to it (bounds
    below)."""
    from tests.worker.train.test_worker_e2e import (
        SMALL,
        assert_matches_reference,
        run_worker,
        small_config,
    )

    dump = tmp_path / "state.pt"
    # --same-node off: the tensors travel in the messages, not through /dev/shm.
    run_worker(["--ps", ps_address, "--same-node", "off", "--staleness", "0",
                "--wire-dtype", wire_dtype, "--run-id", f"wire-{wire_dtype}-{os.urandom(3).hex()}",
                "--dump-state", str(dump), *SMALL])
    cfg = small_config()
    if wire_dtype == "fp32":
        assert_matches_reference(dump, cfg)
        return
    from tests.testing.reference_trainer import train_reference

    state = torch.load(dump)
    ref = train_reference(cfg, world_size=2)
    # Training feeds the rounding back (the next gradients differ a little), and Adam turns
    # a near-zero gradient whose sign flipped into a full step: so a few elements end up
    # about 1 lr away. The mean error grows with the steps a row takes: smallest on the
    # 2000-row user table, largest on the small category table whose rows step every time
    # (measured values: docs/performance-log.md, "--wire-dtype").
    for name, rows in state["tables"].items():
        err = (rows - ref.tables[name]).abs()
        assert float(err.max()) <= 2 * cfg.optim.lr, (name, float(err.max()))
        assert float(err.mean()) <= 0.25 * cfg.optim.lr, (name, float(err.mean()))
    assert any(not torch.equal(rows, ref.tables[name])
               for name, rows in state["tables"].items()), "bf16 was not on the wire"


def test_worker_refuses_unix_addresses() -> None:
    """The server listens on TCP only: a unix: address is refused, naming what to give."""
    for address in ("unix:/tmp/ps.sock", "unix:rel.sock,10.0.0.2:50051"):
        with pytest.raises(ValueError, match=r"is not HOST:PORT: the server listens on TCP "
                           r"only; give its HOST:PORT") as raised:
            TrainConfig.of(ps=address)
        assert f"ps={address.split(',')[0]!r}" in str(raised.value)  # the bad entry


# -- flag validation ---------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--wire-dtype", "fp8"], "wire_dtype='fp8' is not one of fp32, bf16, fp16"),
    (["--ps", "unix:/tmp/ps.sock"], "ps='unix:/tmp/ps.sock' is not HOST:PORT: the server "
                                   "listens on TCP only"),
])
def test_worker_flags_name_bad_values(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    full = argv if "--ps" in argv else [*argv, "--ps", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, full, environ={})
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--kernel-threads", "-1"], "--kernel-threads -1 must be in [0, 64]"),
    (["--kernel-threads", "65"], "--kernel-threads 65 must be in [0, 64]"),
    (["--kernel-threads", "two"], "--kernel-threads='two': expected int"),
    (["--uds", "/tmp/x.sock"], "error: unrecognized arguments: --uds /tmp/x.sock"),
])
def test_server_flags_name_bad_values(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(ServerConfig, argv, environ={})
    assert message in capsys.readouterr().err


def test_server_flags_from_environment() -> None:
    cfg = parse_config(ServerConfig, [], environ={"HYBRIDPS_KERNEL_THREADS": "3"})
    assert cfg.kernel_threads == 3
    with pytest.raises(ValueError, match="wire dtype"):
        _client("127.0.0.1:1", 10, 2, wire_dtype=torch.int8)


@pytest.mark.e2e
def test_kernel_threads_env_zero_means_default() -> None:
    """HYBRIDPS_KERNEL_THREADS=0 (the server's default) must not break importing hybridps.optim."""
    import subprocess

    code = "import hybridps.optim as o; print(o.kernel_info()['threads'] >= 1)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HYBRIDPS_KERNEL_THREADS": "0"}, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "True"


def test_bound_constants_are_what_the_docs_say() -> None:
    for dtype, rel in ROUNDING.items():
        assert math.isclose(rel, torch.finfo(dtype).eps / 2)
