"""The job's proof for its shard servers: the run secret kept with its checkpoints.

Rank 0 claims --checkpoint-dir for the run (hybridps/run_secret.py: it reads the run
secret kept there, or writes a new one with the owner file), reads the secret of the
checkpoint it resumes from (and claims that directory when it predates run secrets),
and gives the secrets to every rank; each rank then claims the same directory on its own
host (a no-op on a shared file system). Every Register carries the secret
(worker/sync/client.py), so a rank restarted by torchrun, or a new job resuming from the
directory under any run id and world size, proves it is the same job: it may restore the
run's checkpoints and take over its partitions, which nobody else may.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybridps.cli import ConfigError
from hybridps.run_secret import RunClaimError, claim_directory, new_secret, read_secret


@dataclass(frozen=True)
class RunProof:
    secret: str
    restore_secret: str = ""  # the secret of the checkpoint resumed from, when another


def claim_run(checkpoint_dir: str, resume_dir: Path | None, rank: int, world_size: int,
              *, claim_resume: bool = True) -> RunProof:
    """Collective: the run's proof (module doc). `resume_dir`: the step directory resumed
    from; `claim_resume`: claim its directory when it holds no secret (False with
    --local-optimizer: no server asks for the proof). ConfigError naming the directory
    when one cannot be used."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [_claim_first(checkpoint_dir, resume_dir, claim_resume)]
        except RunClaimError as exc:
            box = [str(exc)]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    proof = RunProof(*box[0])
    if rank != 0:
        try:
            _claim_again(checkpoint_dir, resume_dir, proof, claim_resume)
        except RunClaimError as exc:
            raise ConfigError(str(exc)) from None
    return proof


def _claim_first(checkpoint_dir: str, resume_dir: Path | None,
                 claim_resume: bool) -> tuple[str, str]:
    source = resume_dir.parent if resume_dir is not None else None
    restore = read_secret(source) if source is not None else None
    if checkpoint_dir:
        secret = claim_directory(checkpoint_dir, prefer=restore)
    else:
        secret = restore or new_secret()
    if source is not None and restore is None and claim_resume:
        restore = claim_directory(source, prefer=secret)  # checkpoints of before run secrets
    return secret, restore if restore and restore != secret else ""


def _claim_again(checkpoint_dir: str, resume_dir: Path | None, proof: RunProof,
                 claim_resume: bool) -> None:
    if checkpoint_dir and claim_directory(checkpoint_dir, prefer=proof.secret) != proof.secret:
        raise RunClaimError(f"checkpoint directory {checkpoint_dir!r} holds another run "
                            "secret on this rank's host than on rank 0's; give every rank "
                            "the same --checkpoint-dir on a shared file system")
    if resume_dir is not None and claim_resume:
        expected = proof.restore_secret or proof.secret
        if claim_directory(resume_dir.parent, prefer=expected) != expected:
            raise RunClaimError(f"the checkpoint directory {str(resume_dir.parent)!r} holds "
                                "another run secret on this rank's host than on rank 0's")
