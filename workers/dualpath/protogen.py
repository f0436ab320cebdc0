"""Generate the gRPC stubs from proto/ (`make proto`). Generated files are never hand-edited.

Compiles every proto/dualpath/v1/*.proto into workers/, so they import as
`dualpath.v1.<name>_pb2` / `_pb2_grpc`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "workers"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("dualpath/v1/*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}/dualpath/v1")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out_dir / "dualpath" / "v1"
    init = pkg / "__init__.py"
    if not init.exists():
        init.write_text(
            '"""Generated gRPC contracts (from proto/dualpath/v1, by `make proto`)."""\n'
        )
    return sorted(pkg.glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
