"""Who may speak for a partition: its secret, the Sync connections bound to it, and who
may register (take over) a partition this server holds. Transport-free, no grpc.

`Store` (ps/core/store.py) inherits these; the servicers call them before anything changes:
every call after Register carries the partition's secret (hybridps/partition_secret.py
says where), compared in constant time (Partition.secret_matches). The rules are in
docs/deploy.md, "Partition secrets".
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hybridps.errors import InvalidArgument, NotRegistered, WrongSecret
from hybridps.names import describe_problem
from hybridps.run_secret import digests_match
from ps.core.partition import Partition


def check_run_id(run_id: str, what: str) -> None:
    """InvalidArgument naming the value unless `run_id` is a safe name (hybridps/names.py)."""
    problem = describe_problem("run_id", run_id)
    if problem is not None:
        raise InvalidArgument(f"{what}: {problem}")


@dataclass(frozen=True)
class Binding:
    """A Sync connection bound to one partition (`Store.bind`): every push on it must be
    of that (run, rank), and the partition must still be the one it was bound to, with
    the secret it presented."""

    run_id: str
    rank: int
    partition: Partition
    secret: str


class PartitionAuth:
    """The secret checks and the takeover rule, over the store's partitions."""

    server_id: str
    _lock: threading.Lock
    _partitions: dict[tuple[str, int], Partition]
    # (run_id, rank) -> Sync connections bound to it (a partition in use: see `bind`)
    _bound: collections.Counter[tuple[str, int]]

    def partitions(self) -> list[Partition]:
        raise NotImplementedError

    def _check_takeover(self, held: Partition, secret: str, digest: str,
                        restore_step: int | None, what: str) -> bool:
        """May this Register replace or take over `held`? False: the caller holds its
        secret; True: a takeover; WrongSecret otherwise, with nothing changed.

        A takeover needs no Sync connection bound to the partition, and either nothing
        pushed yet (nothing to lose: a process restarted before its first step) or a
        checkpoint restored (`restore_step`) with proof that the caller is the same job:
        the run secret the partition was registered with (`digest`, its sha256). A
        partition registered without a run secret (an older client) has no such proof to
        give: it may be restored by anyone, but never moved back to an older step."""
        if secret and held.secret_matches(secret):
            return False
        pushed = max((t.last_step for t in held.tables.values()), default=-1)
        with self._lock:
            connections = self._bound[(held.run_id, held.rank)]
        why = "a wrong partition secret" if secret else "no partition secret"
        if connections:
            raise WrongSecret(
                f"{what}: run {held.run_id!r} rank {held.rank} is registered on this server "
                f"(incarnation {held.incarnation}) and {connections} Sync connection(s) use "
                f"it; a Register with {why} may not take it over (stop the process that "
                "holds it, or use a fresh --run-id)")
        if pushed < 0:
            return True
        if restore_step is None:
            raise WrongSecret(
                f"{what}: run {held.run_id!r} rank {held.rank} is registered on this server "
                f"with optimizer state through step {pushed}; a Register with {why} may "
                "take it over only by restoring a checkpoint (--resume), or use a fresh "
                "--run-id")
        if held.run_digest and not digests_match(held.run_digest, digest):
            raise WrongSecret(
                f"{what}: run {held.run_id!r} rank {held.rank} holds optimizer state through "
                f"step {pushed}; a Register with {why} takes it over only with the run's "
                f"secret, and this one carries {'another' if digest else 'none'} (the run "
                "secret is kept in the run's checkpoint directory: resume from the run's "
                "own checkpoints, or use a fresh --run-id)")
        if not held.run_digest and restore_step < pushed:
            raise WrongSecret(
                f"{what}: run {held.run_id!r} rank {held.rank} holds optimizer state through "
                f"step {pushed}, registered without a run secret; a Register with {why} may "
                f"not move it back to step {restore_step} (use a fresh --run-id)")
        return True

    def _check_unused(self, run_id: str, rank: int, world_size: int, digest: str,
                      what: str) -> None:
        """A restore drops the run's partitions of another world size: none may be in use,
        and every one with state must be of the caller's run secret (the same job)."""
        with self._lock:
            others = [(key[1], p) for key, p in self._partitions.items()
                      if key[0] == run_id and key[1] != rank and p.world_size != world_size]
            busy = sorted(r for r, _ in others if self._bound[(run_id, r)])
        if busy:
            raise WrongSecret(
                f"{what}: restoring at world size {world_size} would drop ranks {busy} of the "
                "run (registered at another world size), which Sync connections still use")
        foreign = sorted(r for r, p in others if p.run_digest
                         and not digests_match(p.run_digest, digest)
                         and any(t.last_step >= 0 for t in p.tables.values()))
        if foreign:
            raise WrongSecret(
                f"{what}: restoring at world size {world_size} would drop ranks {foreign} of "
                "the run, which hold state of another run secret (not this job's)")

    # -- the partition secret (checked for every call after Register) --------------------

    def secret(self, run_id: str, rank: int) -> str:
        """The secret of a registered partition (tests; Register answers it)."""
        part = self._partitions.get((run_id, rank))
        if part is None:
            raise NotRegistered(f"run {run_id!r} rank {rank} is not registered on this server")
        return part.secret

    def check_secret(self, run_id: str, rank: int, given: str, what: str) -> Partition:
        """The partition, if `given` is its secret (compared in constant time);
        WrongSecret otherwise. Nothing changes either way."""
        part = self._partitions.get((run_id, rank))
        if part is None:
            check_run_id(run_id, what)
            raise NotRegistered(f"{what}: run {run_id!r} rank {rank} is not registered on "
                                f"this server (server {self.server_id})")
        if not given or not part.secret_matches(given):
            raise WrongSecret(f"{what}: {'missing' if not given else 'wrong'} partition "
                              f"secret for run {run_id!r} rank {rank} (the one its Register "
                              "answered)")
        return part

    def check_run_secret(self, run_id: str, ranks: Sequence[int], given: str,
                         what: str) -> None:
        """A call naming several ranks of a run (all: `ranks` empty or [-1]) carries the
        secret of one of them: the ranks of a run are one job. WrongSecret otherwise."""
        check_run_id(run_id, what)
        whole = not ranks or list(ranks) == [-1]
        parts = [p for p in self.partitions()
                 if p.run_id == run_id and (whole or p.rank in ranks)]
        if not parts:
            return  # the call itself says what is not registered
        matched = False
        for part in parts:  # every one compared, in constant time each
            matched |= bool(given) and part.secret_matches(given)
        if not matched:
            raise WrongSecret(f"{what}: {'missing' if not given else 'wrong'} partition "
                              f"secret: it must be that of a rank it names of run {run_id!r}")

    def bind(self, run_id: str, rank: int, given: str, what: str) -> Binding:
        """Bind a Sync connection to a partition whose secret it presents; `unbind` at
        its end. While any is bound, the partition is in use (`_check_takeover`)."""
        if rank < 0:
            raise InvalidArgument(f"{what}: rank={rank} must be >= 0")
        self.authorize(run_id, [rank], given, what)
        with self._lock:
            part = self._partitions.get((run_id, rank))
            if part is None:
                raise NotRegistered(f"{what}: run {run_id!r} rank {rank} was dropped")
            self._bound[(run_id, rank)] += 1
        return Binding(run_id, rank, part, given)

    def unbind(self, binding: Binding) -> None:
        key = (binding.run_id, binding.rank)
        with self._lock:
            self._bound[key] -= 1
            if self._bound[key] <= 0:
                del self._bound[key]

    def check_bound(self, binding: Binding, run_id: str, rank: int, what: str) -> None:
        """A push on a bound connection: of its partition, still registered as it was."""
        if (run_id, rank) != (binding.run_id, binding.rank):
            if (run_id, rank) not in self._partitions:  # as on an unbound stream
                check_run_id(run_id, what)
                raise NotRegistered(f"{what}: run {run_id!r} rank {rank} is not registered "
                                    f"on this server (server {self.server_id})")
            raise WrongSecret(f"{what}: this Sync connection is bound to run "
                              f"{binding.run_id!r} rank {binding.rank}, not run {run_id!r} "
                              f"rank {rank}")
        part = self._partitions.get((run_id, rank))
        if part is None:
            raise NotRegistered(f"{what}: run {run_id!r} rank {rank} is no longer registered "
                                f"on this server (server {self.server_id})")
        if part is not binding.partition or not part.secret_matches(binding.secret):
            raise WrongSecret(f"{what}: run {run_id!r} rank {rank} was registered again since "
                              "this Sync connection opened; open a new one with the new "
                              "secret")

    def connections(self, run_id: str, rank: int) -> int:
        """Sync connections bound to (run_id, rank)."""
        with self._lock:
            return self._bound[(run_id, rank)]

    def authorize(self, run_id: str, ranks: Sequence[int], given: str, what: str) -> None:
        """The check of a call after Register: one rank's secret (`check_secret`), or, for a
        call naming several or all (empty, or [-1]) ranks of a run, one of theirs
        (`check_run_secret`). A refusal is counted (under its reason) and raised."""
        try:
            if len(ranks) == 1 and ranks[0] >= 0:
                self.check_secret(run_id, ranks[0], given, what)
            else:
                self.check_run_secret(run_id, ranks, given, what)
        except (WrongSecret, NotRegistered, InvalidArgument) as exc:
            one = len(ranks) == 1 and ranks[0] >= 0
            self.record_refusal(exc.reason, run_id, ranks[0] if one else None)
            raise

    def record_refusal(self, reason: str, run_id: str = "", rank: int | None = None,
                       table: str = "") -> None:
        raise NotImplementedError
