"""Regenerate the gRPC/protobuf Python code under hybridps/v1 from proto/.

Run with the pinned generator (the `dev` extra pins grpcio-tools):
    python scripts/gen_proto.py            # write into the source tree
    python scripts/gen_proto.py --out DIR  # write elsewhere (the no-diff test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
PINNED_GRPCIO_TOOLS = "1.85.1"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != PINNED_GRPCIO_TOOLS:
        raise SystemExit(
            f"grpcio-tools {version} is installed; the generated code is pinned to "
            f"{PINNED_GRPCIO_TOOLS} (pip install grpcio-tools=={PINNED_GRPCIO_TOOLS})"
        )
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted((out_dir / "hybridps" / "v1").glob("*_pb2*.py*"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
