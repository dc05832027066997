"""KGE scoring functions that own only the dense parameters.

Entity embeddings are not here: they live in the sharded (row-wise) embedding table and arrive
as input rows. Each model holds the relation embeddings (``2 R`` rows with reciprocals) and any
small extra weights, so under FSDP2 the whole module is dense.

Every model scores a triple as ``<query(h, r), t> + bias(h, r)``: linear in the tail row. That
gives the two calls the training loop needs:

``score_triples(h_rows [B, D], rel_ids [B], t_rows [B, D]) -> [B]``
    for negative sampling / true-triple scores. Implemented with an explicit per-triple
    product (a separate code path from ``score_against``; the tests check they agree).
``score_against(h_rows [B, D], rel_ids [B], entity_rows [E, D]) -> [B, E]``
    1-vs-all against a block of entity rows (the rows one rank owns). Sharded scoring: compute
    ``q, bias = model.query(h_rows, rel_ids)`` once per batch and call
    ``score_query(q, bias, rows)`` for each block; the column blocks concatenate to the full
    ``score_against`` exactly up to float rounding.

Layouts of a D-wide entity row (the relation rows use the same layout):
    DistMult  D reals.
    ComplEx   [real (D/2) | imaginary (D/2)].
    QMult     [a | b | c | d] quaternion components, D/4 each.
    Keci      [scalar part (k) | e_1..e_p part (k x p, row-major) | e_{p+1}..e_{p+q} part (k x q)]
              with k = D / (1 + p + q): dicee's layout.

Initialisation follows dicee's defaults (``init_param=None``): relation rows N(0, 1), and
``init_entity_rows`` (N(0, 1)) is what the sharded entity table should use for parity with the
single-process reference. Dropout and the N3 / L2 penalties are the trainer's
(worker/tasks/kge/task.py): ``query(..., rel_mask)`` takes a relation dropout mask and
``squared_moduli`` gives the per-coordinate magnitudes the penalties use.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "ComplEx",
    "DistMult",
    "KGEScorer",
    "Keci",
    "QMult",
    "build_model",
    "init_entity_rows",
]


def init_entity_rows(
    num_rows: int, entity_dim: int, generator: torch.Generator | None = None
) -> Tensor:
    """Initial entity rows, N(0, 1) like ``nn.Embedding`` (dicee's default)."""
    return torch.randn(num_rows, entity_dim, generator=generator)


class KGEScorer(nn.Module):
    """Base class: ``relation`` is an ``nn.Embedding(num_relations, relation_dim)``."""

    entity_dim: int
    num_relations: int

    def __init__(self, num_relations: int, entity_dim: int, relation_dim: int | None = None):
        super().__init__()
        if num_relations <= 0 or entity_dim <= 0:
            raise ValueError("num_relations and entity_dim must be positive")
        self.num_relations = num_relations
        self.entity_dim = entity_dim
        self.relation = nn.Embedding(num_relations, relation_dim or entity_dim)
        nn.init.normal_(self.relation.weight, 0.0, 1.0)

    # -- to implement
    def query(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
        """(q [B, D], bias [B] or None) such that score(h, r, t) = q . t + bias.

        `rel_mask` [B, relation_dim] (optional) multiplies the relation rows: dropout."""
        raise NotImplementedError

    def squared_moduli(self, rows: Tensor) -> Tensor:
        """[B, k] squared magnitude of each coordinate of rows in this model's algebra (the
        N3 / L2 penalty is sum |x_i|^p = sum squared_moduli ** (p / 2)): |x_i|^2 per real."""
        return rows * rows

    def relation_rows(self, rel_ids: Tensor, rel_mask: Tensor | None = None) -> Tensor:
        rows: Tensor = self.relation(rel_ids)
        return rows if rel_mask is None else rows * rel_mask

    def score_triples(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor) -> Tensor:
        raise NotImplementedError

    # -- shared
    @staticmethod
    def score_query(q: Tensor, bias: Tensor | None, entity_rows: Tensor) -> Tensor:
        """[B, E] scores of precomputed queries against a block of entity rows."""
        s = q @ entity_rows.t()
        return s if bias is None else s + bias.unsqueeze(1)

    def score_against(self, h_rows: Tensor, rel_ids: Tensor, entity_rows: Tensor) -> Tensor:
        self._check(h_rows, rel_ids)
        if entity_rows.dim() != 2 or entity_rows.shape[1] != self.entity_dim:
            raise ValueError(
                f"entity_rows must be [E, {self.entity_dim}], got {tuple(entity_rows.shape)}"
            )
        q, bias = self.query(h_rows, rel_ids)
        return self.score_query(q, bias, entity_rows)

    def forward(self, h_rows: Tensor, rel_ids: Tensor, entity_rows: Tensor) -> Tensor:
        return self.score_against(h_rows, rel_ids, entity_rows)

    def _check(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor | None = None) -> None:
        if h_rows.dim() != 2 or h_rows.shape[1] != self.entity_dim:
            raise ValueError(f"h_rows must be [B, {self.entity_dim}], got {tuple(h_rows.shape)}")
        if rel_ids.shape != (h_rows.shape[0],):
            raise ValueError(f"rel_ids must be [{h_rows.shape[0]}], got {tuple(rel_ids.shape)}")
        if t_rows is not None and t_rows.shape != h_rows.shape:
            raise ValueError(f"t_rows must be {tuple(h_rows.shape)}, got {tuple(t_rows.shape)}")


class DistMult(KGEScorer):
    """score = sum_i h_i r_i t_i."""

    def query(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
        return h_rows * self.relation_rows(rel_ids, rel_mask), None

    def score_triples(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor) -> Tensor:
        self._check(h_rows, rel_ids, t_rows)
        return (h_rows * self.relation(rel_ids) * t_rows).sum(dim=1)


class ComplEx(KGEScorer):
    """score = Re(<h, r, conj(t)>) with [real | imag] halves."""

    def __init__(self, num_relations: int, entity_dim: int):
        if entity_dim % 2:
            raise ValueError("ComplEx needs an even entity_dim")
        super().__init__(num_relations, entity_dim)

    def query(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
        hr, hi = h_rows.chunk(2, dim=1)
        rr, ri = self.relation_rows(rel_ids, rel_mask).chunk(2, dim=1)
        return torch.cat([hr * rr - hi * ri, hr * ri + hi * rr], dim=1), None

    def squared_moduli(self, rows: Tensor) -> Tensor:
        re, im = rows.chunk(2, dim=1)
        return re * re + im * im

    def score_triples(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor) -> Tensor:
        self._check(h_rows, rel_ids, t_rows)
        hr, hi = h_rows.chunk(2, dim=1)
        rr, ri = self.relation(rel_ids).chunk(2, dim=1)
        tr, ti = t_rows.chunk(2, dim=1)
        return (hr * rr * tr + hi * rr * ti + hr * ri * ti - hi * ri * tr).sum(dim=1)


def _hamilton(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    a1, b1, c1, d1 = a
    a2, b2, c2, d2 = b
    return (
        a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
        a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
        a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
        a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
    )


class QMult(KGEScorer):
    """Quaternion model: score = <h (x) r, t> (Hamilton product, QuatE-style).

    With ``unit_relation`` (default) each relation quaternion is normalised to unit length
    before the product, as in QuatE / dicee's QMult.
    """

    def __init__(self, num_relations: int, entity_dim: int, unit_relation: bool = True):
        if entity_dim % 4:
            raise ValueError("QMult needs entity_dim divisible by 4")
        super().__init__(num_relations, entity_dim)
        self.unit_relation = unit_relation

    def _rel(self, rel_ids: Tensor, rel_mask: Tensor | None = None) -> tuple[Tensor, ...]:
        parts = self.relation_rows(rel_ids, rel_mask).chunk(4, dim=1)
        if self.unit_relation:
            norm = torch.sqrt(torch.stack([p * p for p in parts]).sum(dim=0) + 1e-12)
            parts = tuple(p / norm for p in parts)
        return parts

    def query(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
        prod = _hamilton(h_rows.chunk(4, dim=1), self._rel(rel_ids, rel_mask))
        return torch.cat(prod, dim=1), None

    def squared_moduli(self, rows: Tensor) -> Tensor:
        return torch.stack([p * p for p in rows.chunk(4, dim=1)]).sum(dim=0)

    def score_triples(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor) -> Tensor:
        self._check(h_rows, rel_ids, t_rows)
        prod = _hamilton(h_rows.chunk(4, dim=1), self._rel(rel_ids))
        terms = [(x * t).sum(dim=1) for x, t in zip(prod, t_rows.chunk(4, dim=1), strict=True)]
        return torch.stack(terms).sum(dim=0)


class Keci(KGEScorer):
    """Clifford-algebra model in Cl_{p,q}(R), dicee's Keci.

    A row is k multivectors of grade <= 1: ``x = x0 + sum_i x_i e_i`` with e_i^2 = +1 for the
    first p bases and -1 for the last q. The score is the inner product of the grade-0/1 parts
    of the Clifford product ``h r`` with t, plus (as in dicee) the sum of the bivector
    coefficients of ``h r`` (a per-query constant; it does not change rankings, only logits):

        (h r)_0   = h0 r0 + sum_i sig_i h_i r_i
        (h r)_i   = h0 r_i + h_i r0
        (h r)_ij  = h_i r_j - h_j r_i          (i < j, bivector e_i e_j)

    With ``coefficients`` (default, as dicee) the e_i parts of h and r (not t) are scaled by
    learnable per-basis weights that start at zero, so training starts as DistMult on the
    scalar part and grows into the algebra. Keci(p=0, q=0) is DistMult; (0, 1) is ComplEx-like.
    """

    def __init__(
        self, num_relations: int, entity_dim: int, p: int = 0, q: int = 1, coefficients: bool = True
    ):
        if p < 0 or q < 0 or entity_dim % (1 + p + q):
            raise ValueError(f"Keci needs entity_dim divisible by 1 + p + q = {1 + p + q}")
        super().__init__(num_relations, entity_dim)
        self.p, self.q = p, q
        self.k = entity_dim // (1 + p + q)
        self.coefficients = coefficients
        sig = torch.cat([torch.ones(p), -torch.ones(q)])
        self.register_buffer("signature", sig, persistent=False)
        if coefficients and p + q > 0:
            self.coef = nn.Parameter(torch.zeros(p + q))
        else:
            self.register_parameter("coef", None)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[B, D] -> scalar part [B, k], vector part [B, k, p + q] (p bases then q bases)."""
        b, k, p, q = x.shape[0], self.k, self.p, self.q
        x0 = x[:, :k]
        xp = x[:, k : k + k * p].reshape(b, k, p)
        xq = x[:, k + k * p :].reshape(b, k, q)
        return x0, torch.cat([xp, xq], dim=2)

    def _merge(self, x0: Tensor, xv: Tensor) -> Tensor:
        b, p = x0.shape[0], self.p
        return torch.cat([x0, xv[:, :, :p].reshape(b, -1), xv[:, :, p:].reshape(b, -1)], dim=1)

    def _operands(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h0, hv = self._split(h_rows)
        r0, rv = self._split(self.relation_rows(rel_ids, rel_mask))
        if self.coef is not None:
            hv = hv * self.coef
            rv = rv * self.coef
        return h0, hv, r0, rv

    def query(self, h_rows: Tensor, rel_ids: Tensor, rel_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
        h0, hv, r0, rv = self._operands(h_rows, rel_ids, rel_mask)
        sig: Tensor = self.signature  # type: ignore[assignment]
        s0 = h0 * r0 + (hv * rv * sig).sum(dim=2)
        sv = h0.unsqueeze(2) * rv + hv * r0.unsqueeze(2)
        n = self.p + self.q
        if n < 2:
            return self._merge(s0, sv), None
        # sum_{i<j} (h_i r_j - h_j r_i) = sum_j r_j * (sum_{i<j} h_i) - sum_j h_j * (sum_{i<j} r_i)
        hc = torch.cumsum(hv, dim=2) - hv
        rc = torch.cumsum(rv, dim=2) - rv
        bias = (rv * hc - hv * rc).sum(dim=(1, 2))
        return self._merge(s0, sv), bias

    def score_triples(self, h_rows: Tensor, rel_ids: Tensor, t_rows: Tensor) -> Tensor:
        """Explicit Clifford product per triple (independent of ``query``)."""
        self._check(h_rows, rel_ids, t_rows)
        h0, hv, r0, rv = self._operands(h_rows, rel_ids)
        t0, tv = self._split(t_rows)
        n = self.p + self.q
        score = (h0 * r0 * t0).sum(dim=1)
        for i in range(n):
            sign = 1.0 if i < self.p else -1.0
            hi, ri, ti = hv[:, :, i], rv[:, :, i], tv[:, :, i]
            score = score + sign * (hi * ri * t0).sum(dim=1)
            score = score + ((h0 * ri + hi * r0) * ti).sum(dim=1)
            for j in range(i + 1, n):
                score = score + (hi * rv[:, :, j] - hv[:, :, j] * ri).sum(dim=1)
        return score


_MODELS: dict[str, type[KGEScorer]] = {
    "distmult": DistMult,
    "complex": ComplEx,
    "qmult": QMult,
    "keci": Keci,
}


def build_model(name: str, num_relations: int, entity_dim: int, **kwargs: int | bool) -> KGEScorer:
    """Build a scorer by name (case-insensitive): DistMult, ComplEx, QMult, Keci (p=, q=)."""
    try:
        cls = _MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown KGE model {name!r}; known: {sorted(_MODELS)}") from None
    return cls(num_relations, entity_dim, **kwargs)  # type: ignore[arg-type]
