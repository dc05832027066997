"""A fresh c10d store namespace for every incarnation of the worker group.

Why this exists: since torch 2.4 torchrun's c10d rendezvous hands the workers ONE
TCPStore that the agent hosts and keeps across `--max-restarts` restarts
(TORCHELASTIC_USE_AGENT_STORE=True; torch's own comment in `_create_c10d_store`,
"we create a new TCPStore for every retry", is no longer true). `init_process_group`
and `new_group` write their gloo/NCCL connection info under FIXED key names (group
"0", "1", ... in the same order every time), so after a restart the store still holds
the dead incarnation's addresses. A rank that reads a peer's key before that peer
overwrote it dials a dead process's port: "Gloo connectFullMesh failed ... Connection
refused" in init_process_group or new_group, intermittently (a race between the ranks'
start-up). pytorch/pytorch#135712 is the same bug seen with NCCL.

TORCHELASTIC_RESTART_COUNT as the namespace is not enough: each agent counts its own
restarts, and on several nodes an agent that restarts for a membership change does not
count it, so two nodes can disagree. Instead rank 0 takes a new generation number from
the store (`add`, never reused) and hands it to every other rank by a handshake no stale
key can fake: each rank posts a fresh random nonce, rank 0 answers every nonce it sees
with the generation, and a rank proves it is alive by acknowledging under
(generation, nonce). Keys left by a dead incarnation carry an old nonce that nobody
acknowledges under the new generation. Every process group is then created inside
`hybridps/gen<N>/`, where no stale key can be.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger("worker.rendezvous")

PREFIX = "hybridps/incarnation"
POLL_S = 0.01


def _hello(rank: int) -> str:
    return f"{PREFIX}/hello/{rank}"


def _answer(nonce: str) -> str:
    return f"{PREFIX}/answer/{nonce}"


def _ack(generation: int, nonce: str) -> str:
    return f"{PREFIX}/ack/{generation}/{nonce}"


def agree_generation(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """The generation number of this incarnation, the same on every rank (see module doc)."""
    nonce = uuid.uuid4().hex
    if rank != 0:
        store.set(_hello(rank), nonce)
        generation = int(store.get(_answer(nonce)))  # blocks up to the store's timeout
        store.set(_ack(generation, nonce), "1")
        return generation
    generation = store.add(f"{PREFIX}/counter", 1)
    answered: dict[int, str] = {}  # rank -> the nonce last answered
    pending = set(range(1, world_size))
    deadline = time.monotonic() + timeout_s
    while pending:
        for peer in sorted(pending):
            if not store.check([_hello(peer)]):
                continue
            peer_nonce = store.get(_hello(peer)).decode()
            if answered.get(peer) != peer_nonce:  # a new (or a stale) nonce: answer it
                store.set(_answer(peer_nonce), str(generation))
                answered[peer] = peer_nonce
            if store.check([_ack(generation, peer_nonce)]):
                pending.discard(peer)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0: ranks {sorted(pending)} of {world_size} did not join generation "
                f"{generation} of the process group within {timeout_s:.0f}s")
        if pending:
            time.sleep(POLL_S)
    return generation


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float,
                       device_id: torch.device | None = None) -> int:
    """`dist.init_process_group` from torchrun's env inside a namespace of this
    incarnation; returns the generation. Groups made later (new_group, device meshes)
    use the same store, so they live in the namespace too."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # torch's own env:// store: a client of the agent's store under torchrun, else a
    # store hosted by rank 0 (fresh at every launch; the handshake is then just cheap).
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                       timeout=timeout))
    store.set_timeout(timeout)
    generation = agree_generation(store, rank, world_size, timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore(f"hybridps/gen{generation}/",
                                                            store),
                            rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)
    log.info("rank %d: process group generation %d (world size %d, torchrun restart count "
             "%s)", rank, generation, world_size,
             os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"))
    return generation
