"""The committed gRPC stubs are exactly what `make proto` generates from proto/."""

from pathlib import Path

from dualpath import protogen


def test_generated_stubs_match_the_protos(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "no stubs generated"
    committed = protogen.OUT_DIR / "dualpath" / "v1"
    for path in fresh:
        mine = committed / path.name
        assert mine.exists(), f"{mine} missing: run make proto"
        assert mine.read_text() == path.read_text(), f"{mine.name} is stale: run make proto"
