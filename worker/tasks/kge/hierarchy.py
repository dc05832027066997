"""A sparse, WordNet-like knowledge graph, generated deterministically and written as
train.txt / valid.txt / test.txt: the sparse-graph check of docs/kge.md needs a graph of
tens of thousands of entities with few triples each, and WN18RR cannot ship here.

    python -m worker.tasks.kge.hierarchy runs/hier20k --entities 20000
    python -m worker.main --task kge --data-dir runs/hier20k ...

The graph (pure numpy, a function of (entities, seed) only):
- a forest: `categories` roots (WordNet's lexicographer files); every other entity picks a
  parent among the earlier ones, preferentially one that already has children (a Yule
  process: fan-outs from 1 to hundreds, depths of ~5-10), and inherits its category;
- `_hypernym` (child -> parent) for every non-root;
- `_derivationally_related_form`, both directions: an entity and one of the partner
  category (c + C/2 mod C) at the mirrored place of its list (about a third of them);
- `_has_part`, `_member_meronym`: an entity with children -> a child of a node its parent
  is mapped to (a fixed map per relation into another category), so siblings have their
  parts in one subtree;
- `_synset_domain_topic_of`: an entity -> one of a few topic hubs, fixed by its ancestor
  at depth 2 (one in ten);
- `_verb_group`, `_also_see`, `_similar_to`: symmetric links of an entity to a sibling.
Valid and test are drawn from all the triples so that every entity of a held-out triple
keeps at least one training triple (as in WN18RR). At 20,000 entities: ~40k train
triples, 2 per entity (WN18RR: 86,835 over 40,943), 9 relations (WN18RR: 11).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Triple = tuple[int, str, int]
SYMMETRIC = ("_verb_group", "_also_see", "_similar_to")


def _forest(n: int, categories: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """parent [n] (-1 for the roots 0..categories-1) and category [n] of every entity."""
    parent = np.full(n, -1, dtype=np.int64)
    category = np.arange(n, dtype=np.int64) % categories
    has_child: list[int] = []  # entities with a child, one entry per child (preferential)
    coin = rng.random(n)
    pick = rng.random(n)
    for i in range(categories, n):
        if has_child and coin[i] < 0.7:
            p = has_child[int(pick[i] * len(has_child))]
        else:
            p = int(pick[i] * i)
        parent[i] = p
        category[i] = category[p]
        has_child.append(p)
    return parent, category


def hierarchy_triples(num_entities: int, *, seed: int = 0, categories: int = 24
                      ) -> list[Triple]:
    """Every triple of the graph (module doc), in a fixed order."""
    if num_entities < 4 * categories:
        raise ValueError(f"num_entities={num_entities} must be at least 4 x categories "
                         f"({4 * categories})")
    rng = np.random.default_rng([seed, 11])
    n = num_entities
    parent, category = _forest(n, categories, rng)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(categories, n):
        children[int(parent[i])].append(i)
    members = [np.flatnonzero(category == c) for c in range(categories)]
    out: list[Triple] = [(i, "_hypernym", int(parent[i])) for i in range(categories, n)]

    half = categories // 2
    for i in map(int, np.flatnonzero(rng.random(n) < 0.35)):
        c = int(category[i])
        mine, theirs = members[c], members[(c + half) % categories]
        place = int(np.searchsorted(mine, i)) / len(mine)
        j = int(theirs[min(int(place * len(theirs)), len(theirs) - 1)])
        if j != i:
            out += [(i, "_derivationally_related_form", j),
                    (j, "_derivationally_related_form", i)]

    for relation, shift in (("_has_part", 3), ("_member_meronym", 7)):
        target = np.array([members[(int(category[x]) + shift) % categories][
            rng.integers(len(members[(int(category[x]) + shift) % categories]))]
            for x in range(n)], dtype=np.int64)  # the fixed map of each node
        for i in range(categories, n):
            if children[i] and rng.random() < 0.5:
                anchor = int(target[int(parent[i])])
                kids = children[anchor]
                j = kids[int(rng.integers(len(kids)))] if kids else anchor
                if j != i:
                    out.append((i, relation, j))

    hubs = rng.choice(n, size=max(4, categories), replace=False)
    depth2 = np.arange(n, dtype=np.int64)  # the ancestor one below the root
    for i in range(categories, n):
        p = int(parent[i])
        depth2[i] = i if parent[p] < 0 else depth2[p]
    for i in map(int, np.flatnonzero(rng.random(n) < 0.1)):
        hub = int(hubs[depth2[i] % len(hubs)])
        if hub != i:
            out.append((i, "_synset_domain_topic_of", hub))

    for i in range(categories, n):
        siblings = children[int(parent[i])]
        if len(siblings) > 1 and rng.random() < 0.15:
            j = siblings[int(rng.integers(len(siblings)))]
            if j != i:
                relation = SYMMETRIC[int(category[i]) % len(SYMMETRIC)]
                out += [(i, relation, j), (j, relation, i)]
    return list(dict.fromkeys(out))  # no duplicate triple, first occurrence kept


def split_triples(triples: Sequence[Triple], held_out: int, *, seed: int = 0
                  ) -> dict[str, list[Triple]]:
    """train / valid / test: `held_out` triples each for valid and test, drawn at random
    among those whose two entities keep another triple in train."""
    rng = np.random.default_rng([seed, 12])
    degree: dict[int, int] = {}
    for h, _, t in triples:
        degree[h] = degree.get(h, 0) + 1
        degree[t] = degree.get(t, 0) + 1
    chosen: list[int] = []
    for k in rng.permutation(len(triples)):
        h, _, t = triples[int(k)]
        if degree[h] > 1 and degree[t] > 1:
            degree[h] -= 1
            degree[t] -= 1
            chosen.append(int(k))
            if len(chosen) == 2 * held_out:
                break
    if len(chosen) < 2 * held_out:
        raise ValueError(f"only {len(chosen)} triples can be held out, not {2 * held_out}")
    out = set(chosen)
    return {"train": [x for k, x in enumerate(triples) if k not in out],
            "valid": [triples[k] for k in chosen[:held_out]],
            "test": [triples[k] for k in chosen[held_out:]]}


def write_hierarchy(directory: str | Path, num_entities: int, *, seed: int = 0,
                    held_out: int | None = None) -> dict[str, int]:
    """Generate the graph into `directory` (train/valid/test.txt); returns the counts.
    `held_out` (valid and test each): by default 3.75% of the triples, as in WN18RR."""
    triples = hierarchy_triples(num_entities, seed=seed)
    if held_out is None:
        held_out = max(1, round(0.0375 * len(triples)))
    splits = split_triples(triples, held_out, seed=seed)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    width = len(str(num_entities - 1))
    for name, rows in splits.items():
        text = "".join(f"e{h:0{width}d}\t{r}\te{t:0{width}d}\n" for h, r, t in rows)
        (d / f"{name}.txt").write_text(text)
    used = {e for h, _, t in triples for e in (h, t)}
    return {"entities": len(used), **{k: len(v) for k, v in splits.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.tasks.kge.hierarchy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write train.txt, valid.txt, test.txt into")
    parser.add_argument("--entities", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        counts = write_hierarchy(args.out, args.entities, seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
