"""A KGE run whose scores collapsed to uniform, found early and said in one line.

What collapse is. Every entity gets the same score (all embeddings ~0): the softmax over the
entities is uniform, so the training loss sits at ln(E) (1vsAll, KvsAll with --loss ce;
ln(1 + k) for negative sampling with --loss ce) and valid MRR at chance, H_E / E (a random
ranking; exact ties give ~2 / E). A model that learned anything, even only how popular each
tail is, is far above both.

Why it happens: the penalty outweighs the data. With N3 (per occurrence, as here) and a
score bounded by the three moduli, as ComplEx's and DistMult's are,
    score(h, r, t) = Re sum_i h_i r_i conj(t_i) <= sum_i |h_i| |r_i| |t_i|
                   <= sum_i (|h_i|^3 + |r_i|^3 + |t_i|^3) / 3          (AM-GM)
so along any ray from the origin the penalty lambda * (|h|^3 + |r|^3 + |t|^3) grows at least
3 lambda times as fast as the score can, and the softmax CE falls at most as fast as the
true tail's score rises (it is convex in the scale, its slope at 0 is -(score of the true
tail - the mean score)). For lambda >= 1/3 (the geometric mean of the entity, relation and
entity weights) no direction improves on the all-zero model: uniform scores are the optimum
of the objective, not an optimiser accident (docs/kge.md, "Sparse or dense graph?").

The check (KGEHooks.after_eval): at an evaluation after the first epoch, collapsed when
  - the loss is a softmax over all entities (or over 1 + k): the mean training loss of the
    last --log-every window is within 1% of the uniform loss (either side: at collapse the
    penalty is ~0 too) AND valid MRR is below
    min(10 x chance, 0.05);
  - otherwise (bce): valid MRR below min(3 x chance, 0.05);
at `EVALUATIONS` evaluations in a row. Then one warning line (`event=collapse ...
change="..."`) names the values and what to change, and training stops (like early
stopping: the final evaluation and the results are still written). A collapsed run does
not come back: at the origin every gradient of a product score vanishes.
"""

from __future__ import annotations

import math

from worker.config.kge_options import KGEOptions

EVALUATIONS = 2           # evaluations in a row that must look collapsed
LOSS_MARGIN = 0.01        # relative distance to the uniform loss
MRR_CAP = 0.05            # never call a ranking with this valid MRR collapsed
ZERO_OPTIMAL_WEIGHT = 1.0 / 3.0
BOUNDED_MODELS = ("complex", "distmult")  # score <= sum_i |h_i| |r_i| |t_i|


def chance_mrr(num_entities: int) -> float:
    """Expected MRR of a random ranking of E entities: H_E / E."""
    e = max(num_entities, 1)
    harmonic = sum(1.0 / k for k in range(1, e + 1)) if e < 10_000 else (
        math.log(e) + 0.5772156649 + 1.0 / (2 * e))
    return harmonic / e


def uniform_loss(training: str, loss: str, num_entities: int, neg_ratio: int
                 ) -> float | None:
    """The training loss of uniform scores, where the loss is a softmax (else None)."""
    if loss != "ce":
        return None
    return math.log(1 + neg_ratio) if training == "negsample" else math.log(num_entities)


def effective_n3_weight(options: KGEOptions) -> float:
    """The geometric mean of the weights on |h|^3, |r|^3, |t|^3."""
    entity, relation = options.reg_weight, options.relation_reg_weight
    return float((entity * entity * max(relation, 0.0)) ** (1.0 / 3.0))


def zero_model_is_optimal(options: KGEOptions, model: str) -> bool:
    """N3 strong enough that the all-zero model is the optimum (module doc)."""
    return (options.reg == "n3" and model.lower() in BOUNDED_MODELS
            and effective_n3_weight(options) >= ZERO_OPTIMAL_WEIGHT)


def what_to_change(options: KGEOptions, model: str, lr: float) -> str:
    if zero_model_is_optimal(options, model):
        return (f"--reg n3 --reg-weight {options.reg_weight:g} makes the all-zero model the "
                "optimum (a score is at most the mean of |h|^3, |r|^3, |t|^3): use 0.05 (the "
                "presets) to 0.1; just below 1/3 is not enough (docs/kge.md)")
    if options.reg != "none" and options.reg_weight > 0:
        return (f"the penalty outweighs the data: lower --reg-weight (now "
                f"{options.reg_weight:g}; the presets use 0.05)")
    if options.entity_dropout or options.relation_dropout:
        return (f"lower --entity-dropout / --relation-dropout (now {options.entity_dropout:g} "
                f"/ {options.relation_dropout:g}) or raise --lr (now {lr:g})")
    return f"the rows do not move: raise --lr (now {lr:g}) and --init-std"


class CollapseCheck:
    """Counts evaluations in a row that look collapsed (module doc); `observe` returns the
    one-line report when there are EVALUATIONS of them."""

    def __init__(self, *, num_entities: int, uniform: float | None, advice: str) -> None:
        self.num_entities, self.uniform, self.advice = num_entities, uniform, advice
        self.chance = chance_mrr(num_entities)
        self.in_a_row = 0

    def looks_collapsed(self, mrr: float, loss: float | None) -> bool:
        if self.uniform is not None:
            if loss is None or not math.isfinite(loss):
                return False
            # both sides: a loss above it is confidently wrong scores, not uniform ones
            return (abs(loss - self.uniform) <= LOSS_MARGIN * self.uniform
                    and mrr < min(10 * self.chance, MRR_CAP))
        return mrr < min(3 * self.chance, MRR_CAP)

    def observe(self, *, mrr: float, loss: float | None, epoch: float
                ) -> dict[str, object] | None:
        """After an evaluation at `epoch` (epochs done, fractional): the report's fields
        (a `kv("collapse", ...)` log line) once EVALUATIONS in a row looked collapsed."""
        if epoch < 1.0 or not self.looks_collapsed(mrr, loss):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.in_a_row < EVALUATIONS:
            return None
        fields: dict[str, object] = {"epoch": round(epoch, 3), "valid_mrr": f"{mrr:.4g}",
                                     "chance_mrr": f"{self.chance:.2g}",
                                     "entities": self.num_entities}
        if self.uniform is not None and loss is not None:
            fields.update(loss=f"{loss:.4f}", uniform_loss=f"{self.uniform:.4f}")
        fields.update(scores="uniform", change=self.advice, action="training stopped")
        return fields
