from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from worker.tasks.kge.models import (
    ComplEx,
    DistMult,
    Keci,
    KGEScorer,
    QMult,
    build_model,
    init_entity_rows,
)

R, D = 7, 24


def _keci(p: int, q: int) -> Keci:
    m = Keci(R, D, p=p, q=q)
    if m.coef is not None:  # leave the zero init so all terms are exercised
        torch.nn.init.normal_(m.coef)
    return m


FACTORIES: dict[str, Callable[[], KGEScorer]] = {
    "distmult": lambda: DistMult(R, D),
    "complex": lambda: ComplEx(R, D),
    "qmult": lambda: QMult(R, D),
    "keci00": lambda: _keci(0, 0),
    "keci01": lambda: _keci(0, 1),
    "keci21": lambda: _keci(2, 1),
    "keci12": lambda: _keci(1, 2),
    "keci30_nocoef": lambda: Keci(R, D, p=3, q=0, coefficients=False),
}


@pytest.fixture(params=sorted(FACTORIES))
def model(request: pytest.FixtureRequest) -> KGEScorer:
    torch.manual_seed(0)
    return FACTORIES[request.param]().double()


def _inputs(b: int = 9, e: int = 31) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ent = init_entity_rows(e, D, generator=g).double()
    h = torch.randn(b, D, generator=g, dtype=torch.float64)
    r = torch.randint(0, R, (b,), generator=g)
    return h, r, ent


def test_shapes(model: KGEScorer) -> None:
    h, r, ent = _inputs()
    assert model.score_against(h, r, ent).shape == (9, 31)
    assert model.score_triples(h, r, ent[:9]).shape == (9,)
    assert model.entity_dim == D and model.num_relations == R


def test_block_scores_equal_columns_of_full(model: KGEScorer) -> None:
    h, r, ent = _inputs()
    full = model.score_against(h, r, ent)
    for a, b in [(0, 10), (10, 11), (11, 31), (5, 5)]:
        torch.testing.assert_close(model.score_against(h, r, ent[a:b]), full[:, a:b])
    q, bias = model.query(h, r)
    blocks = [model.score_query(q, bias, ent[a:b]) for a, b in [(0, 13), (13, 31)]]
    torch.testing.assert_close(torch.cat(blocks, dim=1), full)


def test_score_triples_is_diagonal_of_score_against(model: KGEScorer) -> None:
    h, r, ent = _inputs(b=12, e=12)
    full = model.score_against(h, r, ent)
    torch.testing.assert_close(model.score_triples(h, r, ent), full.diagonal())


def test_gradients_reach_inputs_and_dense_params(model: KGEScorer) -> None:
    h, r, ent = _inputs()
    h.requires_grad_(True)
    ent.requires_grad_(True)
    (model.score_against(h, r, ent).sum() + model.score_triples(h, r, ent[:9]).sum()).backward()
    assert h.grad is not None and ent.grad is not None
    assert h.grad.abs().sum() > 0 and ent.grad.abs().sum() > 0
    assert model.relation.weight.grad is not None
    # only relation rows that were used get gradient
    used = torch.zeros(R, dtype=torch.bool)
    used[r] = True
    assert (model.relation.weight.grad[~used] == 0).all()
    # the module holds dense parameters only: no entity table inside
    assert all(p.shape[0] != 31 for p in model.parameters())


def test_keci_special_cases_match_distmult_and_complex() -> None:
    h, r, ent = _inputs()
    k00 = Keci(R, D, p=0, q=0).double()
    dm = DistMult(R, D).double()
    dm.relation.weight.data.copy_(k00.relation.weight.data)
    torch.testing.assert_close(k00.score_against(h, r, ent), dm.score_against(h, r, ent))
    k01 = Keci(R, D, p=0, q=1, coefficients=False).double()
    cx = ComplEx(R, D).double()
    cx.relation.weight.data.copy_(k01.relation.weight.data)
    torch.testing.assert_close(k01.score_against(h, r, ent), cx.score_against(h, r, ent))


def test_keci_zero_coefficients_start_as_distmult_on_scalar_part() -> None:
    h, r, ent = _inputs()
    k = Keci(R, D, p=1, q=1).double()  # coefficients start at zero (dicee)
    kk = D // 3
    dm = DistMult(R, kk).double()
    dm.relation.weight.data.copy_(k.relation.weight.data[:, :kk])
    torch.testing.assert_close(
        k.score_against(h, r, ent), dm.score_against(h[:, :kk], r, ent[:, :kk])
    )


def test_qmult_unit_relation_is_norm_preserving() -> None:
    m = QMult(R, D).double()
    h, r, _ = _inputs()
    q, _ = m.query(h, r)
    # |h (x) r| = |h| |r| per quaternion; with |r| = 1 the query norm equals the head norm
    torch.testing.assert_close(q.norm(dim=1), h.norm(dim=1))


def test_build_model_and_validation() -> None:
    assert isinstance(build_model("DistMult", R, D), DistMult)
    k = build_model("keci", R, D, p=2, q=1)
    assert isinstance(k, Keci) and (k.p, k.q, k.k) == (2, 1, 6)
    with pytest.raises(ValueError):
        build_model("transx", R, D)
    with pytest.raises(ValueError):
        ComplEx(R, 5)
    with pytest.raises(ValueError):
        Keci(R, 10, p=1, q=1)
    m = DistMult(R, D)
    with pytest.raises(ValueError):
        m.score_against(torch.zeros(3, D), torch.zeros(3, dtype=torch.long), torch.zeros(4, D + 1))
    with pytest.raises(ValueError):
        m.score_triples(torch.zeros(3, D), torch.zeros(2, dtype=torch.long), torch.zeros(3, D))
