"""worker/tasks/base.py: a Batch goes to the device through device_copy.to_device (pinned
host buffers and non-blocking copies on CUDA), every tensor of it."""

from __future__ import annotations

import pytest
import torch

import worker.tasks.base as base
from worker.tasks.base import Batch


def test_batch_to_copies_every_tensor_through_to_device(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    seen: list[tuple[torch.Tensor, torch.device]] = []

    def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        seen.append((tensor, device))
        return tensor.clone()

    monkeypatch.setattr(base, "to_device", to_device)
    ids, bag_ids, offsets = torch.arange(3), torch.arange(5), torch.tensor([0, 2, 4])
    label = torch.zeros(3)
    batch = Batch(3, ids={"a": ids}, bags={"b": (bag_ids, offsets)}, values={"label": label})
    moved = batch.to("cpu")
    assert [id(t) for t, _ in seen] == [id(ids), id(bag_ids), id(offsets), id(label)]
    assert all(d == torch.device("cpu") for _, d in seen)
    assert torch.equal(moved.ids["a"], ids) and moved.ids["a"] is not ids
    assert torch.equal(moved.bags["b"][1], offsets) and moved.size == 3


def test_batch_to_the_cpu_keeps_the_tensors() -> None:
    ids = torch.arange(4)
    assert Batch(4, ids={"a": ids}).to("cpu").ids["a"] is ids
