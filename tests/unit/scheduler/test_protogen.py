"""The committed gRPC stubs are exactly what `make proto` generates from proto/."""

import subprocess
import sys
from pathlib import Path

from dualpath import protogen


def test_generated_stubs_match_the_protos(tmp_path: Path):
    # A subprocess: grpc_tools' bundled protoc must not load beside torch/protobuf (it crashes).
    subprocess.run(
        [sys.executable, "-m", "dualpath.protogen", str(tmp_path)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    fresh = sorted((tmp_path / "dualpath" / "v1").glob("*_pb2*.py*"))
    assert fresh, "no stubs generated"
    committed = protogen.OUT_DIR / "dualpath" / "v1"
    for path in fresh:
        mine = committed / path.name
        assert mine.exists(), f"{mine} missing: run make proto"
        assert mine.read_text() == path.read_text(), f"{mine.name} is stale: run make proto"
