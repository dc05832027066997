"""The committed generated code matches proto/ when regenerated with the pinned tools."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs the dev extra")
def test_regeneration_makes_no_diff(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted((tmp_path / "hybridps" / "v1").glob("*_pb2*"))
    assert generated, "gen_proto.py wrote nothing"
    for path in generated:
        committed = ROOT / "hybridps" / "v1" / path.name
        assert committed.exists(), f"{committed} is not committed"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.relative_to(ROOT)} differs from freshly generated code: "
            "run `python scripts/gen_proto.py` and commit"
        )


def test_generated_modules_import_from_installed_package() -> None:
    # Imports as installed (`from hybridps.v1 import ...`), not via a path hack.
    from hybridps.v1 import admin_pb2_grpc, shard_pb2, shard_pb2_grpc

    assert shard_pb2.DESCRIPTOR.package == "hybridps.v1"
    assert hasattr(shard_pb2_grpc, "ShardServiceStub")
    assert hasattr(admin_pb2_grpc, "AdminServiceStub")
