"""A trained KGE model as one file and a plain PyTorch module that scores triples with it.

Needs torch only (and ``models.py`` beside it, the scoring functions): no process group, no shard
server, no hybridps. Copy this file and ``worker/tasks/kge/models.py`` next to each other to
use an export anywhere.

    python -m worker.export --state run.pt --kge-results run.json --out model.pt
    model = KGEModel.load("model.pt")
    model.score_names([("/m/02mjmr", "/people/person/nationality", "/m/09c7w0")])
    model.predict_tails("/m/02mjmr", "/people/person/nationality", k=10)
    link_prediction_metrics(model, "DIR/FB15k-237", split="test")   # filtered MRR, Hits@k
    link_prediction_metrics(model, "umls", split="test")   # a shipped set by name, as --data-dir

The file (torch.save of a dict, format ``hybridps-kge-v1``) holds the model name and options,
the entity rows [E, D], the scorer's state (relation rows [2R, D]: reciprocals are r + R, and
any model weights) and the entity / relation id maps (name -> id), so names travel with it.
Head prediction (?, r, t) is the tail query (t, r + R, ?) of the reciprocal relation, as in
training and in the run's own evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from worker.tasks.kge.models import KGEScorer, build_model
except ImportError:  # copied next to models.py, outside the package
    from models import KGEScorer, build_model  # type: ignore[no-redef]
try:  # --data-dir's rule: a directory, else the name of a set shipped with hybridps
    from hybridps.datasets import resolve_data_dir
except ImportError:  # copied outside the repository: directories only
    resolve_data_dir = Path  # type: ignore[assignment]

FORMAT = "hybridps-kge-v1"
SCORER_PREFIX = "scorer."


def export_payload(entity_rows: torch.Tensor, dense_state: dict[str, torch.Tensor], *,
                   model: str, model_options: dict[str, Any], num_relations: int,
                   entity_to_id: dict[str, int], relation_to_id: dict[str, int]
                   ) -> dict[str, Any]:
    """The export dict. `dense_state`: the task's dense module state (KGEDense: scorer.*);
    `num_relations`: the base relations R (the scorer holds 2R rows)."""
    scorer = {k[len(SCORER_PREFIX):]: v.detach().cpu().clone() for k, v in dense_state.items()
              if k.startswith(SCORER_PREFIX)}
    if not scorer:
        raise ValueError(f"the dense state has no {SCORER_PREFIX}* keys: not a KGE model")
    if len(entity_to_id) != entity_rows.shape[0]:
        raise ValueError(f"{len(entity_to_id)} entity names for {entity_rows.shape[0]} rows")
    if len(relation_to_id) != num_relations:
        raise ValueError(f"{len(relation_to_id)} relation names for {num_relations} relations")
    return {"format": FORMAT, "model": model, "model_options": dict(model_options),
            "dim": int(entity_rows.shape[1]), "num_relations": int(num_relations),
            "entity": entity_rows.detach().cpu().float().clone(), "scorer": scorer,
            "entity_to_id": dict(entity_to_id), "relation_to_id": dict(relation_to_id)}


def payload_from_run(state: dict[str, torch.Tensor], results_json: str | Path
                     ) -> dict[str, Any]:
    """The export of a plain state_dict (worker/export.py: embedding.tables.entity.weight,
    dense.scorer.*) of the run whose --results is `results_json` (model, options, and the
    id maps in <results>.id_maps/)."""
    import json

    path = Path(results_json)
    res = json.loads(path.read_text())
    task = res["task"]
    maps = path.with_name(path.stem + ".id_maps")
    entity_to_id = json.loads((maps / "entity_to_id.json").read_text(encoding="utf-8"))
    relation_to_id = json.loads((maps / "relation_to_id.json").read_text(encoding="utf-8"))
    dense = {k[len("dense."):]: v for k, v in state.items() if k.startswith("dense.")}
    return export_payload(state["embedding.tables.entity.weight"], dense, model=task["model"],
                          model_options=task.get("model_options") or {},
                          num_relations=int(task["relations"]), entity_to_id=entity_to_id,
                          relation_to_id=relation_to_id)


class KGEModel(nn.Module):
    """Entity rows + a scorer: score(h, r, t) = q(h, r) . t + bias(h, r)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__()
        if payload.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} export (format {payload.get('format')!r})")
        self.model_name = str(payload["model"])
        self.num_relations = int(payload["num_relations"])
        self.entity = nn.Embedding.from_pretrained(payload["entity"], freeze=True)
        self.scorer: KGEScorer = build_model(self.model_name, 2 * self.num_relations,
                                             int(payload["dim"]), **payload["model_options"])
        self.scorer.load_state_dict(payload["scorer"])
        self.scorer.requires_grad_(False)
        self.entity_to_id: dict[str, int] = dict(payload["entity_to_id"])
        self.relation_to_id: dict[str, int] = dict(payload["relation_to_id"])
        self.id_to_entity = {i: n for n, i in self.entity_to_id.items()}
        self.eval()

    @classmethod
    def load(cls, path: str | Path) -> KGEModel:
        return cls(torch.load(path, map_location="cpu", weights_only=True))

    # -- ids ------------------------------------------------------------------------------
    def ids(self, triples: Iterable[Sequence[str]]) -> torch.Tensor:
        """[N, 3] int64 ids of (head, relation, tail) names; KeyError names an unknown one."""
        rows = [(self.entity_to_id[h], self.relation_to_id[r], self.entity_to_id[t])
                for h, r, t in triples]
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)

    # -- scores ---------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Scores of triples given by id ([N] each); r may be a reciprocal (r + R)."""
        q, bias = self.scorer.query(self.entity(h), r)
        s = (q * self.entity(t)).sum(dim=1)
        return s if bias is None else s + bias

    @torch.no_grad()
    def score_all_tails(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """[N, num_entities] scores of (h, r, e) for every entity e."""
        q, bias = self.scorer.query(self.entity(h), r)
        return self.scorer.score_query(q, bias, self.entity.weight)

    def forward(self, triples_N3: torch.Tensor) -> torch.Tensor:
        return self.score(triples_N3[:, 0], triples_N3[:, 1], triples_N3[:, 2])

    def score_names(self, triples: Iterable[Sequence[str]]) -> torch.Tensor:
        return self.forward(self.ids(triples))

    def predict_tails(self, head: str, relation: str, k: int = 10) -> list[tuple[str, float]]:
        """The k best tails of (head, relation, ?) by score (unfiltered)."""
        h = torch.tensor([self.entity_to_id[head]])
        r = torch.tensor([self.relation_to_id[relation]])
        top = self.score_all_tails(h, r)[0].topk(min(k, self.entity.num_embeddings))
        return [(self.id_to_entity[int(i)], float(s))
                for s, i in zip(top.values, top.indices, strict=True)]

    def predict_heads(self, relation: str, tail: str, k: int = 10) -> list[tuple[str, float]]:
        """The k best heads of (?, relation, tail): the tail query of the reciprocal."""
        t = torch.tensor([self.entity_to_id[tail]])
        r = torch.tensor([self.relation_to_id[relation] + self.num_relations])
        top = self.score_all_tails(t, r)[0].topk(min(k, self.entity.num_embeddings))
        return [(self.id_to_entity[int(i)], float(s))
                for s, i in zip(top.values, top.indices, strict=True)]


def read_triples(path: str | Path) -> list[tuple[str, str, str]]:
    """head<TAB>relation<TAB>tail lines (the training data's format)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        h, r, t = line.split("\t")
        out.append((h, r, t))
    return out


@torch.no_grad()
def filtered_ranks(model: KGEModel, triples_N3: torch.Tensor, known_N3: torch.Tensor,
                   batch_size: int = 256) -> torch.Tensor:
    """Filtered ranks of both directions (ties count half, as the trainer's evaluation):
    tail queries (h, r, ?) then head queries as (t, r + R, ?); every triple in `known`
    (train + valid + test) other than the answer is left out of the ranking."""
    num_rel = model.num_relations
    rec = lambda x: torch.stack([x[:, 2], x[:, 1] + num_rel, x[:, 0]], 1)  # noqa: E731
    queries = torch.cat([triples_N3, rec(triples_N3)])
    known = torch.cat([known_N3, rec(known_N3)])
    pair_key = known[:, 0] * (2 * num_rel) + known[:, 1]
    order = torch.argsort(pair_key)
    keys, tails = pair_key[order], known[order, 2]
    ranks = []
    for s in range(0, len(queries), batch_size):
        qb = queries[s:s + batch_size]
        scores = model.score_all_tails(qb[:, 0], qb[:, 1])
        true = scores.gather(1, qb[:, 2:3])
        qkey = qb[:, 0] * (2 * num_rel) + qb[:, 1]
        lo = torch.searchsorted(keys, qkey)
        hi = torch.searchsorted(keys, qkey, right=True)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        for i in range(len(qb)):
            mask[i, tails[lo[i]:hi[i]]] = True
        mask.scatter_(1, qb[:, 2:3], False)  # the answer itself is ranked
        greater = ((scores > true) & ~mask).sum(1)
        equal = ((scores == true) & ~mask).sum(1) - 1  # not the answer itself
        ranks.append(1.0 + greater.double() + equal.double() / 2)
    return torch.cat(ranks)


def link_prediction_metrics(model: KGEModel, data_dir: str | Path, split: str = "test"
                            ) -> dict[str, float]:
    """Filtered MRR, MR and Hits@1/3/10 of a split of a data directory (train/valid/test.txt),
    both directions: what the training run reports as `<split>_*`. `data_dir` is read as
    --data-dir is: a directory, else the name of a set shipped with hybridps ("umls")."""
    if split not in ("train", "valid", "test"):
        raise ValueError(f"split={split!r} must be train, valid or test")
    d = resolve_data_dir(data_dir)
    parts = {s: model.ids(read_triples(d / f"{s}.txt")) for s in ("train", "valid", "test")
             if (d / f"{s}.txt").is_file()}
    if split not in parts:
        raise FileNotFoundError(f"{d / f'{split}.txt'} not found (data_dir={str(data_dir)!r}: "
                                "a directory of train/valid/test.txt or a shipped set's name)")
    ranks = filtered_ranks(model, parts[split], torch.cat(list(parts.values())))
    out = {"mrr": float((1.0 / ranks).mean()), "mr": float(ranks.mean())}
    out.update({f"hits@{k}": float((ranks <= k).double().mean()) for k in (1, 3, 10)})
    return out
