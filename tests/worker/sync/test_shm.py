"""The same-node shared-memory data plane of the Sync stream (worker/sync/arena.py,
ps/edge/arena_server.py).

Every test that runs the feature checks that it was used (the client's shm counters,
the server's log), so a silent fallback to inline tensors fails them.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest
import torch

from hybridps import arena_layout as layout
from hybridps.cli import parse_config
from hybridps.errors import AnswerEvicted, BadShmReference, StaleShmEpoch
from ps.config import ServerConfig
from ps.edge.arena_server import ArenaRefused, ServerArena, ShmRef, check_ref, open_arena
from tests.testing.helpers import start_ps_server
from tests.worker.sync.test_wire_fast import (
    SPEC,
    _client,
    _push_all,
    _reference_deltas,
    _run,
    _steps,
)
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig
from worker.sync.arena import ClientArena, RingAllocator, place
from worker.sync.client import ServerRefused, ShardClient

ROWS, DIM = 2000, 32


# -- the allocator and the arena file ----------------------------------------------------

def test_ring_allocator_reuses_space_in_fifo_order_and_wraps() -> None:
    ring = RingAllocator(0, 1024)
    a, b, c = (ring.alloc(256) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert [a.offset, b.offset, c.offset] == [0, 256, 512]
    assert ring.alloc(512) is None, "only 256 bytes are free"
    ring.free(b)  # out of order: nothing comes back while `a` is live
    assert ring.used == 768 and ring.alloc(512) is None
    ring.free(a)  # now [0, 512) is free: the next region wraps to the start
    d = ring.alloc(300)
    assert d is not None and d.offset == 0 and d.nbytes == layout.align_up(300)
    assert ring.alloc(256) is None  # [320, 512) is too small, [768, 1024) is behind d
    ring.free(c)
    e = ring.alloc(512)
    assert e is not None and e.offset == d.nbytes
    empty = ring.alloc(0)
    assert empty is not None and empty.nbytes == 0
    ring.free(d)
    ring.free(e)
    assert ring.used == 0 and ring.alloc(1024) is not None


def test_arena_file_is_private_reserved_and_unlinked() -> None:
    arena = ClientArena(2 << 20, rank=3)
    st = os.stat(arena.path)
    assert oct(st.st_mode & 0o777) == "0o600" and st.st_size == arena.size
    assert st.st_blocks * 512 >= arena.size, "pages are reserved up front (no SIGBUS later)"
    magic, nonce, size = layout.unpack_header(Path(arena.path).read_bytes()[:4096])
    assert (magic, nonce, size) == (layout.MAGIC, arena.nonce, arena.size)
    slot = place(arena, torch.arange(5), torch.ones(5, 3), torch.bfloat16, torch.float32)
    assert slot is not None and slot.grads.dtype == torch.bfloat16
    path = arena.path
    arena.close()
    assert not os.path.exists(path)
    assert float(slot.grads.float().sum()) == 15.0, "views outlive close (no unmap under them)"


def test_server_refuses_arenas_that_are_not_the_offered_one(tmp_path: Path) -> None:
    arena = ClientArena(2 << 20, rank=0)
    try:
        mapping, _ = open_arena(arena.path, arena.size, arena.nonce)
        del mapping
        cases = [
            ((arena.path, arena.size, b"x" * 32), "header does not match"),
            ((arena.path, arena.size + 4096, arena.nonce), f"has {arena.size} bytes"),
            ((arena.path, arena.size, b"short"), "nonce of 5 bytes"),
            (("/etc/passwd", arena.size, arena.nonce), "is not an arena file in /dev/shm"),
            ((layout.SHM_DIR + "/hybridps-nope.arena", arena.size, arena.nonce),
             "does not exist here"),
        ]
        for args, message in cases:
            with pytest.raises(ArenaRefused, match=message):
                open_arena(*args)
        os.chmod(arena.path, 0o644)
        with pytest.raises(ArenaRefused, match="mode 0600"):
            open_arena(arena.path, arena.size, arena.nonce)
        link = Path(layout.SHM_DIR) / f"hybridps-link-{os.getpid()}.arena"
        link.symlink_to(arena.path)
        try:
            with pytest.raises(ArenaRefused, match="cannot open"):
                open_arena(str(link), arena.size, arena.nonce)
        finally:
            link.unlink()
    finally:
        arena.close()


# -- reference checks and the epoch fence (pure) -----------------------------------------

def _ref(name: str, dtype: torch.dtype, shape: tuple[int, ...], offset: int,
         length: int | None = None) -> ShmRef:
    n = 1
    for s in shape:
        n *= s
    return ShmRef(name, dtype, str(dtype), shape, offset,
                  n * dtype.itemsize if length is None else length)


@pytest.mark.parametrize(("ref", "message"), [
    (_ref("grads", torch.float32, (4, 2), 4096, 31), "length 31 does not match"),
    (_ref("grads", torch.float32, (4, 2), 4100), "offset 4100 is not a multiple of 64"),
    (_ref("grads", torch.float32, (4, 2), 0), "[0, 32) is outside the arena's data"),
    (_ref("grads", torch.float32, (1 << 20, 2), 4096), "is outside the arena's data"),
    (_ref("grads", torch.float32, (-1, 2), 4096, 0), "negative dimension"),
    (ShmRef("ids", None, "<unknown dtype 77>", (3,), 4096, 24), "cannot travel"),
])
def test_bad_references_name_the_value(ref: ShmRef, message: str) -> None:
    with pytest.raises(BadShmReference, match=message.replace("[", r"\[").replace(")", r"\)")
                       ) as err:
        check_ref(ref, 1 << 20, "push step=3")
    # ... after the push and the whole reference (formatted only when one is refused)
    assert str(err.value).startswith(f"push step=3: {ref.describe()}: ")


def test_views_are_the_mapping_s_bytes() -> None:
    """Views.view: an as_strided view of one whole-mapping tensor per dtype, equal to a
    frombuffer of the same bytes, writing through to the mapping; bad offsets refused."""
    mapping = mmap.mmap(-1, 1 << 16)
    views = layout.Views(mapping)
    data = torch.arange(96, dtype=torch.float32)
    mapping[4096:4096 + 384] = data.numpy().tobytes()
    grads = views.view(4096, torch.float32, (12, 8))
    assert grads.is_contiguous() and grads.shape == (12, 8)
    assert torch.equal(grads, data.view(12, 8))
    assert torch.equal(views.view(4096 + 64, torch.float32, (8,)), data[16:24])
    assert torch.equal(views.view(4096, torch.int64, (2,)),
                       torch.frombuffer(mapping, dtype=torch.int64, count=2, offset=4096))
    grads[1, 0] = -5.0  # the server writes answers this way
    assert torch.frombuffer(mapping, dtype=torch.float32, count=1, offset=4096 + 32).item() \
        == -5.0
    assert views.view(8192, torch.float32, (0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match="offset 4098 is not a multiple of"):
        views.view(4098, torch.float32, (2,))
    with pytest.raises(RuntimeError):  # torch's own bounds check: past the mapping's end
        views.view((1 << 16) - 16, torch.float32, (2, 4))


def test_answer_writes_of_an_old_epoch_are_fenced() -> None:
    import mmap

    arena = ServerArena("/dev/shm/x", 1 << 20, b"n" * 32, mmap.mmap(-1, 1 << 20), epoch=5)
    region = arena.view(_ref("answer", torch.float32, (2, 2), 4096))
    arena.write_answer(5, region, torch.ones(2, 2), "push")
    assert torch.equal(region, torch.ones(2, 2))
    arena.epoch = 6  # the rank registered again
    with pytest.raises(StaleShmEpoch, match="epoch 5 is not the arena's current epoch 6"):
        arena.write_answer(5, region, torch.zeros(2, 2), "push")
    assert torch.equal(region, torch.ones(2, 2)), "a fenced write wrote"


class FakeSink:
    """The core's AnswerSink as a transport gives it (here: plain memory)."""

    def __init__(self, rows: int, dim: int) -> None:
        self.region = torch.zeros(rows, dim)
        self.writes = 0

    @property
    def out(self) -> torch.Tensor:
        return self.region

    def write(self, answer_UD: torch.Tensor) -> None:
        self.writes += 1
        self.region.copy_(answer_UD)


def test_answer_cache_borrows_deltas_written_into_the_sink() -> None:
    """The kernel writes the delta into the rank's region and the cache keeps a view of
    it (no copy): a re-sent push - one the rank got no answer for, so its region still
    holds the delta - is answered from it, by reference or inline."""
    from ps.core.partition import PushChunk, TableSpec
    from ps.core.store import Store

    store = Store(answer_cache_steps=2)
    store.register("r", 0, 1, 1, [TableSpec("t", 100, 4, 0, 100)], SPEC)
    session = store.open_session()
    table = store.partition("r", 0).tables["t"]  # type: ignore[union-attr]
    ids = torch.arange(0, 20, 2)
    sinks = [FakeSink(10, 4) for _ in range(4)]  # one region a step in flight
    grads = [torch.randn(10, 4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    deltas = []
    for step, g in enumerate(grads):
        answer = session.feed(PushChunk("r", 0, 1, step, "t", ids, g, sink=sinks[step]))
        assert answer is not None and answer.delta.data_ptr() == sinks[step].region.data_ptr()
        assert sinks[step].writes == 0, "the kernel writes the delta into the sink itself"
        assert table.answers[step].borrowed
        assert table.answers[step].delta.data_ptr() == sinks[step].region.data_ptr()
        deltas.append(sinks[step].region.clone())
    assert sorted(table.answers) == [2, 3], "the cache holds answer_cache_steps answers"
    # Step 3 re-sent by reference (its answer was lost): the region already holds it.
    dup = session.feed(PushChunk("r", 0, 1, 3, "t", ids, grads[3], sink=sinks[3]))
    assert dup is not None and dup.duplicate and torch.equal(sinks[3].region, deltas[3])
    # Re-sent into another region: copied there from the first one.
    other = FakeSink(10, 4)
    dup = session.feed(PushChunk("r", 0, 1, 3, "t", ids, grads[3], sink=other))
    assert dup is not None and other.writes == 1 and torch.equal(other.region, deltas[3])
    # Re-sent inline (the re-Register fell back): the caller gets its own copy.
    inline = session.feed(PushChunk("r", 0, 1, 2, "t", ids, grads[2]))
    assert inline is not None and inline.duplicate and not inline.borrowed
    assert torch.equal(inline.delta, deltas[2])
    assert inline.delta.data_ptr() != sinks[2].region.data_ptr()
    with pytest.raises(AnswerEvicted, match="no longer held"):
        session.feed(PushChunk("r", 0, 1, 1, "t", ids, grads[1], sink=sinks[1]))
    # Duplicates change nothing: the next step applies on the state after step 3.
    nxt = session.feed(PushChunk("r", 0, 1, 4, "t", ids, grads[0], sink=FakeSink(10, 4)))
    assert nxt is not None and not nxt.duplicate and table.last_step == 4


# -- against a real server -----------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shm_client_equals_inline_client_bitwise(ps_address: str,
                                                 wire_dtype: torch.dtype) -> None:
    ids, grads = _steps(ROWS, DIM, 6)
    shm = _client(ps_address, ROWS, DIM, wire_dtype=wire_dtype, shm="on")
    got = _run(shm, ids, grads)
    inline = _run(_client(ps_address, ROWS, DIM, wire_dtype=wire_dtype), ids, grads)
    assert shm.stats.shm == "on" and shm.stats.shm_pushes == 6
    assert shm.stats.shm_inline_pushes == 0
    assert shm.stats.push_bytes < 6 * 400, "the messages carried tensors"
    for a, b in zip(got, inline, strict=True):
        assert torch.equal(a, b)
    if wire_dtype == torch.float32:
        for a, ref in zip(got, _reference_deltas(grads, ids, ROWS, DIM, wire_dtype),
                          strict=True):
            torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.e2e
def test_bf16_rows_over_shm_equal_inline(ps_address: str) -> None:
    """Master-rows partitions answer rows (bf16) into the region."""
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)) * 0.05

    def client(shm: str) -> ShardClient:
        return _client(ps_address, ROWS, DIM, row_dtype=torch.bfloat16, shm=shm,
                       initial_rows=lambda name: iter([(0, init)]))

    ids, grads = _steps(ROWS, DIM, 4)
    shm = client("on")
    got = _run_rows(shm, ids, grads)
    inline = _run_rows(client("off"), ids, grads)
    assert shm.stats.shm_pushes == 4
    for a, b in zip(got, inline, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def _run_rows(client: ShardClient, ids: list[torch.Tensor],
              grads: list[torch.Tensor]) -> list[torch.Tensor]:
    updates = _push_all(client, ids, grads)
    assert all(u.rows for u in updates)
    return [u.delta_UD.clone() for u in updates]


@pytest.mark.e2e
def test_arena_regions_are_freed_after_the_next_take(ps_address: str) -> None:
    """A small arena: every push still goes by reference because regions come back."""
    client = _client(ps_address, ROWS, DIM, shm="on", shm_bytes=1)  # the minimum, 1 MiB
    ids, grads = _steps(ROWS, DIM, 30)  # 30 x 1000 rows x (8 + 2 x 128) bytes = 7.9 MB
    reference = _reference_deltas(grads, ids, ROWS, DIM, torch.float32)
    client.start()
    try:
        for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
            client.push(step, {"t": (i, g)})
            (update,), _ = client.take(step)
            assert torch.equal(update.ids_U, i)
            torch.testing.assert_close(update.delta_UD, reference[step], rtol=1e-5,
                                       atol=1e-9)
        assert client.stats.shm_pushes == 30 and client.stats.shm_inline_pushes == 0
        # Three pushes of 400 kB in flight do not fit in 1 MiB: one of them goes inline.
        big = torch.arange(ROWS // 2 + 500)
        for step in (30, 31, 32):
            client.push(step, {"t": (big, torch.ones(len(big), DIM))})
        updates, _ = client.take(32)
        assert [u.step for u in updates] == [30, 31, 32]
        assert all(torch.equal(u.ids_U, big) for u in updates)
        assert client.stats.shm_inline_pushes >= 1
        assert client.stats.shm_pushes + client.stats.shm_inline_pushes == 33
    finally:
        client.close()


@pytest.mark.e2e
def test_arena_file_is_gone_once_registered(ps_address: str) -> None:
    client = _client(ps_address, ROWS, DIM, shm="on")
    client.start()
    try:
        arena = client.placement.arena
        assert arena is not None
        assert not os.path.exists(arena.path), "left in /dev/shm after Register"
    finally:
        client.close()
    mine = [p for p in os.listdir(layout.SHM_DIR) if p.startswith(f"hybridps-{os.getpid()}-")]
    assert mine == []


# -- fallback and refusal ----------------------------------------------------------------------

@pytest.mark.e2e
def test_server_with_shm_disabled_gets_inline_pushes(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--shm", "false")
    try:
        ids, grads = _steps(ROWS, DIM, 3)
        auto = _client(server.address, ROWS, DIM, shm="auto")
        got = _run(auto, ids, grads)
        assert auto.stats.shm == "inline: this server runs with --shm false"
        assert auto.stats.shm_pushes == 0 and auto.stats.pushes == 3
        for a, ref in zip(got, _reference_deltas(grads, ids, ROWS, DIM, torch.float32),
                          strict=True):
            torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)
        strict = _client(server.address, ROWS, DIM, shm="on")
        with pytest.raises(ServerRefused, match=r"--same-node require, but shard server .* did not "
                                                r"accept .*--shm false"):
            strict.start()
        strict.close()
    finally:
        server.terminate()
    assert "event=serving" in server.stderr() and "shm=False" in server.stderr()
    assert [p for p in os.listdir(layout.SHM_DIR) if p.startswith(f"hybridps-{os.getpid()}-")] \
        == [], "a refused arena was left behind"


# -- flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--same-node", "maybe"], "same_node='maybe' is not one of auto, off, require"),
    (["--same-node", "stream"], "same_node='stream' is not one of auto, off, require: every "
                                "mode sends the Sync messages on the gRPC stream; auto"),
    (["--same-node-mb", "-1"], "same_node_mb=-1 must be in [0, 1048576]"),
    (["--same-node", "require", "--local-optimizer"], "same_node='require' needs a shard server"),
    # flags that no longer exist are unknown flags, like any other
    (["--shm", "on"], "error: unrecognized arguments: --shm on"),
    (["--shm-mb=16"], "error: unrecognized arguments: --shm-mb=16"),
    (["--shm-socket", "off"], "error: unrecognized arguments: --shm-socket off"),
])
def test_worker_shm_flags_name_bad_values(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    full = argv if "--local-optimizer" in argv else [*argv, "--ps", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, full, environ={})
    assert message in capsys.readouterr().err


def test_server_treats_the_sync_socket_flag_as_unknown(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(ServerConfig, ["--shm-socket", "false"], environ={})
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: unrecognized arguments: --shm-socket false")
    # a variable the server does not read is not its business, like any other
    cfg = parse_config(ServerConfig, [], environ={"HYBRIDPS_SHM_SOCKET": "false"})
    assert cfg == parse_config(ServerConfig, [], environ={})


def test_shm_flags_from_environment() -> None:
    cfg = parse_config(TrainConfig, ["--ps", "127.0.0.1:1"],
                       environ={"HYBRIDPS_SAME_NODE": "off", "HYBRIDPS_SAME_NODE_MB": "256"})
    assert (cfg.node.same_node, cfg.node.same_node_mb) == ("off", 256)
    assert TrainConfig.of(ps="127.0.0.1:1").node.same_node == "auto"
    assert parse_config(ServerConfig, [], environ={"HYBRIDPS_SHM": "false"}).shm is False
    with pytest.raises(ValueError, match="shm='sometimes'"):
        ShardClient("127.0.0.1:1", run_id="r", rank=0, world_size=1,
                    tables=[TableConfig("t", 10, 2)], ranges={"t": (0, 10)}, optimizer=SPEC,
                    timeout_s=1.0, max_chunk_bytes=1 << 20, shm="sometimes")


# -- 2-rank training runs (torchrun) ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_worker_run_over_shm_equals_inline_run_bitwise(ps_address: str,
                                                       tmp_path: Path) -> None:
    from tests.worker.train.test_worker_e2e import (
        SMALL,
        STEPS,
        assert_matches_reference,
        run_worker,
        small_config,
    )

    for mode, same_node in (("on", "require"), ("off", "off")):
        run_worker(["--ps", ps_address, "--staleness", "0", "--same-node", same_node, "--run-id",
                    f"shm-{mode}-{os.urandom(3).hex()}", "--dump-state",
                    str(tmp_path / f"{mode}.pt"), "--results", str(tmp_path / f"{mode}.json"),
                    *SMALL])
    res = json.loads((tmp_path / "on.json").read_text())["sync"]
    assert res["shm"] == "on" and res["shm_pushes"] == STEPS * 4, res
    assert res["shm_batches"] == STEPS and res["push_chunks"] == STEPS, "one message a step"
    assert res["shm_inline_pushes"] == 0
    assert json.loads((tmp_path / "off.json").read_text())["sync"]["shm"] == "off"
    on, off = torch.load(tmp_path / "on.pt"), torch.load(tmp_path / "off.pt")
    for part in ("tables", "dense"):
        assert set(on[part]) == set(off[part])
        for key in on[part]:
            assert torch.equal(on[part][key], off[part][key]), (part, key)
    assert_matches_reference(tmp_path / "on.pt", small_config())


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_broken_stream_over_shm_reconnects_and_resends(tmp_path: Path) -> None:
    """Cut the connections mid-run: re-Register (same arena, new epoch), re-send the
    unanswered pushes by reference, same result as the reference."""
    from tests.worker.train.test_worker_e2e import (
        SMALL,
        STEPS,
        FaultProxy,
        assert_matches_reference,
        run_worker,
        small_config,
    )

    with start_ps_server(tmp_path) as server:
        # Shared-memory pushes are ~100-byte headers, one a step for the 4 tables (one group,
        # --group-tables): the run sends ~9 KB through the proxy, the cut comes mid-run.
        proxy = FaultProxy((server.host, server.port), after=4_000, mode="drop")
        try:
            run_worker(["--ps", f"127.0.0.1:{proxy.port}", "--staleness", "0", "--same-node",
                        "require", "--run-id", "shm-reconnect",
                        "--dump-state", str(tmp_path / "state.pt"),
                        "--results", str(tmp_path / "r.json"), *SMALL])
        finally:
            proxy.close()
        err = server.stderr()
    assert proxy.tripped, f"proxy never cut the connection ({proxy.forwarded} bytes forwarded)"
    res = json.loads((tmp_path / "r.json").read_text())["sync"]
    assert res["reconnects"] >= 1 and res["registers"] >= 2
    assert res["shm"] == "on" and res["shm_pushes"] == STEPS * 4
    assert res["transport"] == "stream"
    assert "event=shm_reattached run=shm-reconnect" in err
    assert_matches_reference(tmp_path / "state.pt", small_config())


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_shm_on_against_a_refusing_server_is_a_clear_error(tmp_path: Path) -> None:
    from tests.worker.train.test_worker_e2e import SMALL, run_worker

    with start_ps_server(tmp_path, "--shm", "false") as server:
        proc = run_worker(["--ps", server.address, "--same-node", "require", *SMALL], check=False,
                          timeout=100)
    assert proc.returncode != 0
    assert (f"--same-node require, but shard server {server.address} did not accept the "
            "shared-memory arena") in proc.stderr
    assert "this server runs with --shm false" in proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_an_inline_push_of_mibs_while_an_inline_answer_of_mibs_waits(ps_address: str) -> None:
    """A push that does not fit in the arena goes inline over the Sync stream; its answer
    (tens of MiB) is written while the next push is being sent: neither may wait on the
    other's full buffer (a hang until the timeout; the KGE scale check at 5M entities met
    it on the former Sync socket). gRPC's flow control reads and writes each direction
    on its own, so the stream must get through with no reconnect."""
    rows, dim = 500_000, 64
    client = ShardClient(ps_address, run_id=f"big-{os.urandom(4).hex()}", rank=0,
                         world_size=1, tables=[TableConfig("t", rows, dim)],
                         ranges={"t": (0, rows)}, optimizer=SPEC, timeout_s=15.0,
                         shm="on", shm_bytes=64 << 20, max_chunk_bytes=4 << 20)
    g = torch.Generator().manual_seed(0)
    sizes = [72_000, 132_000, 72_000]  # the second does not fit beside the first: inline
    client.start()
    try:
        for step, n in enumerate(sizes):
            ids = torch.randperm(rows, generator=g)[:n].sort().values
            client.push(step, {"t": (ids, torch.randn(n, dim, generator=g))})
            if step >= 1:
                client.take(step - 1)
        updates, _ = client.take(len(sizes) - 1)
        assert [u.step for u in updates] == [2]
        assert client.stats.shm_inline_pushes >= 1
        assert client.stats.reconnects == 0
        assert client.stats.transport == "stream"
    finally:
        client.close()
