"""Generates the Python stubs of protos/ into the `tokend.v1` package at the repository root (never edit them).

Runs from scripts/bootstrap.sh and the Dockerfile; a no-op when the stubs are newer than every .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUTPUT_ROOT = ROOT  # protos/tokend/v1/x.proto -> tokend/v1/x_pb2.py, importable as tokend.v1.x_pb2


def main() -> int:
    from grpc_tools import protoc  # imported here so that `--help`-free callers see a clear error first

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    outputs = [OUTPUT_ROOT / p.relative_to(PROTO_ROOT).with_name(p.stem + "_pb2_grpc.py") for p in protos]
    newest_input = max(p.stat().st_mtime for p in [*protos, Path(__file__)])
    if all(o.is_file() and o.stat().st_mtime >= newest_input for o in outputs):
        return 0
    include = Path(protoc.__file__).parent / "_proto"  # the well-known types shipped with grpcio-tools
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUTPUT_ROOT}",
        f"--pyi_out={OUTPUT_ROOT}",
        f"--grpc_python_out={OUTPUT_ROOT}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        print("gen_protos: protoc failed", file=sys.stderr)
        return 1
    for proto in protos:  # every directory on the way becomes a package
        package = OUTPUT_ROOT / proto.relative_to(PROTO_ROOT).parent
        while package != OUTPUT_ROOT:
            init = package / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated from protos/ by scripts/gen_protos.py: do not edit."""\n')
            package = package.parent
    return 0


if __name__ == "__main__":
    sys.exit(main())
