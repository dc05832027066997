"""The kinds of update source and their facts (torch-free: the launcher, the preflight and
the planner read them before torch is imported).

A run's kind is chosen once from its sync section (`SyncConfig.update_kind`): "server" (the
node's shard server, worker/sync/client.py) or "local" (the optimizer in-process,
--local-optimizer, worker/updates/source.py). Callers ask its facts instead of branching
on the flag or on the source's class; worker/sync/update_sources.py builds the source of
each kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridps.cli import ConfigError


@dataclass(frozen=True)
class UpdateKind:
    """What callers need to know about one kind of update source."""

    name: str            # the registry key
    mode: str            # results.json / the checkpoint manifest "mode"
    needs_server: bool   # a shard server is required and contacted, and holds the optimizer
    #                      state (else the state is on the device, next to the rows)
    claims_resume: bool  # the run claims its servers' state on a resume (worker/checkpoint)
    flag: str            # the flag that selects it ("" for the default kind)


UPDATE_KINDS: dict[str, UpdateKind] = {
    "server": UpdateKind("server", mode="server", needs_server=True, claims_resume=True,
                         flag=""),
    "local": UpdateKind("local", mode="local-optimizer", needs_server=False,
                        claims_resume=False, flag="--local-optimizer"),
}


def kind_named(name: str) -> UpdateKind:
    try:
        return UPDATE_KINDS[name]
    except KeyError:
        raise ConfigError(f"unknown update source {name!r} (one of "
                          f"{', '.join(sorted(UPDATE_KINDS))})") from None


def kind_for(local_optimizer: bool) -> UpdateKind:
    """The kind the sync section's flags select (--local-optimizer: "local")."""
    return kind_named("local" if local_optimizer else "server")
