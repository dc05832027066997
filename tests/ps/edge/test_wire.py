from __future__ import annotations

import itertools

import pytest
import torch

from hybridps import wire
from hybridps.v1 import shard_pb2


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
)
def test_roundtrip(dtype: torch.dtype) -> None:
    t = (torch.randn(5, 3) * 100).to(dtype)
    back = wire.decode(shard_pb2.Tensor.FromString(wire.encode(t).SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_empty_tensor_roundtrip() -> None:
    back = wire.decode(wire.encode(torch.empty(0, 7)))
    assert back.shape == (0, 7)


def test_byte_length_mismatch_names_the_numbers() -> None:
    msg = wire.encode(torch.zeros(4, 2))
    msg.data = msg.data[:-1]
    with pytest.raises(wire.WireError, match=r"31 bytes do not match shape \[4, 2\]"):
        wire.decode(msg, "grads")


def test_unknown_dtype_and_negative_shape_are_refused() -> None:
    with pytest.raises(wire.WireError, match="unsupported dtype"):
        wire.decode(shard_pb2.Tensor(dtype=0, shape=[1], data=b"1234"))
    with pytest.raises(wire.WireError, match="negative dimension"):
        wire.decode(shard_pb2.Tensor(dtype=shard_pb2.FLOAT32, shape=[-1], data=b""))


def test_chunking_covers_all_rows_once() -> None:
    per = wire.rows_per_chunk(dim=64, max_chunk_bytes=64 * 1024)
    bounds = list(wire.chunk_bounds(1000, per))
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert list(wire.chunk_bounds(0, per)) == [(0, 0)]
    assert (8 + 64 * 4) * per <= 64 * 1024
