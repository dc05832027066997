"""A KGE run exported with `python -m worker.export --kge-results` loads into KGEModel (plain
torch) and gives the run's own test/valid metrics; the id maps travel in the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.checkpoint.test_checkpoint import REPO, run
from tests.worker.tasks.kge.test_kge_task import write_graph
from worker.tasks.kge.export import KGEModel, export_payload, link_prediction_metrics


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["complex", "keci"])
def test_exported_model_gives_the_runs_metrics(tmp_path: Path, model: str) -> None:
    graph = write_graph(tmp_path / "graph")
    extra = ["--model-config", str(graph / "keci.json")] if model == "keci" else []
    dim = "9" if model == "keci" else "8"  # keci(1, 1): multivectors of 3
    dump, results = tmp_path / "run.pt", tmp_path / "run.json"
    run(["--task", "kge", "--data-dir", str(graph), "--model", model, "--dim", dim,
         "--training", "1vsall", "--epochs", "3", "--lr", "0.05", "--dense-lr", "0.05",
         "--local-optimizer", "--eval-every-epochs", "1", *extra,
         "--dump-state", str(dump), "--results", str(results)])
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "worker.export", "--state", str(dump),
                           "--kge-results", str(results), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = KGEModel.load(out)
    ran = json.loads(results.read_text())["eval"]
    for split in ("valid", "test"):
        got = link_prediction_metrics(loaded, graph, split)
        for key, value in got.items():
            assert value == pytest.approx(ran[f"{split}_{key}"], abs=1e-9), (split, key)
    # names in, names out
    h, r, t = (graph / "test.txt").read_text().splitlines()[0].split("\t")
    score = loaded.score_names([(h, r, t)])
    best = loaded.predict_tails(h, r, k=30)
    assert len(best) == 23 and t in {name for name, _ in best}
    assert score.item() == pytest.approx(dict(best)[t], rel=1e-5)
    assert {name for name, _ in loaded.predict_heads(r, t, k=3)} <= set(loaded.entity_to_id)


def test_export_refuses_mismatched_id_maps() -> None:
    rows = torch.zeros(3, 4)
    dense = {"scorer.relation.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match="2 entity names for 3 rows"):
        export_payload(rows, dense, model="distmult", model_options={}, num_relations=2,
                       entity_to_id={"a": 0, "b": 1}, relation_to_id={"r": 0, "s": 1})
    with pytest.raises(ValueError, match="no scorer"):
        export_payload(rows, {}, model="distmult", model_options={}, num_relations=2,
                       entity_to_id={"a": 0, "b": 1, "c": 2}, relation_to_id={"r": 0, "s": 1})
    with pytest.raises(ValueError, match="not a hybridps-kge-v1"):
        KGEModel({"format": "other"})


def _random_export(entity_to_id: dict[str, int], relation_to_id: dict[str, int]) -> KGEModel:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(len(entity_to_id), 8, generator=gen)
    dense = {"scorer.relation.weight": torch.randn(2 * len(relation_to_id), 8, generator=gen)}
    return KGEModel(export_payload(rows, dense, model="distmult", model_options={},
                                   num_relations=len(relation_to_id),
                                   entity_to_id=entity_to_id, relation_to_id=relation_to_id))


def test_metrics_take_a_shipped_sets_name_as_data_dir_does() -> None:
    from hybridps.datasets import shipped_dataset
    from worker.tasks.kge.data import load_kg_dataset

    ds = load_kg_dataset("umls")  # the name --data-dir umls takes
    model = _random_export(ds.entity_to_id, ds.relation_to_id)
    by_name = link_prediction_metrics(model, "umls", "test")
    assert by_name == link_prediction_metrics(model, shipped_dataset("umls"), "test")
    assert 0.0 < by_name["mrr"] < 1.0
    with pytest.raises(FileNotFoundError, match=r"umsl.*a shipped set.s name"):
        link_prediction_metrics(model, "umsl", "test")
    with pytest.raises(ValueError, match="split='tset'"):
        link_prediction_metrics(model, "umls", "tset")


def test_the_export_line_names_the_step_of_the_rows_exported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --dump-state of a run that restored its best model (step 409 of a 4100-step plan)
    exports step 409's rows and says so; a dump without the step is of the last step."""
    from worker.export import main

    tables = {"entity": torch.zeros(3, 4)}
    best = tmp_path / "best.pt"
    torch.save({"tables": tables, "dense": {}, "steps": 4100, "step": 409, "best": True}, best)
    assert main(["--state", str(best), "--out", str(tmp_path / "a.pt")]) == 0
    assert capsys.readouterr().out.startswith("exported step 409 (best): 1 tensors")
    last = tmp_path / "last.pt"
    torch.save({"tables": tables, "dense": {}, "steps": 20, "step": 19, "best": False}, last)
    assert main(["--state", str(last), "--out", str(tmp_path / "b.pt")]) == 0
    assert capsys.readouterr().out.startswith("exported step 19: 1 tensors")
    older = tmp_path / "older.pt"
    torch.save({"tables": tables, "dense": {}, "steps": 20}, older)
    assert main(["--state", str(older), "--out", str(tmp_path / "c.pt")]) == 0
    assert capsys.readouterr().out.startswith("exported step 19: 1 tensors")
