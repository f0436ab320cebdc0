"""The pods run with `readOnlyRootFilesystem`: every process must serve with nothing writable
but the mounts it is given. Here `dualpath up` runs in a mount namespace whose root filesystem
is remounted read-only (HOME, /tmp, the checkout and the venv included); one directory is left
writable, as the pods' emptyDir and storage volume are. A conversation's second turn must be a
hit, and Ctrl-C must stop the cluster cleanly.

Needs `unshare -m` with the right to mount (root, or a user namespace); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_configs import tiny_local, write_config

pytestmark = pytest.mark.slow

BT = 16
# The namespace's mounts: the writable directory bound onto itself (a mount of its own keeps
# its read-write flag), then the root remounted read-only. Private, so the host sees nothing.
READ_ONLY_ROOT = (
    'mount --make-rprivate / && mount --bind "$RW" "$RW" && mount -o remount,bind,ro / && '
    'if touch /.dualpath-ro-probe 2>/dev/null; then echo "root still writable" >&2; exit 3; fi; '
    'exec "$@"'
)


def _read_only_root_available() -> str | None:
    """None if this machine can run a command under a read-only root, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare binary"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", READ_ONLY_ROOT, "sh", "true"],
        env={**os.environ, "RW": "/dev/shm"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"cannot make the root read-only here: {probe.stderr.strip()[:200]}"
    return None


def test_dualpath_up_serves_hits_on_a_read_only_root(tmp_path: Path) -> None:
    why = _read_only_root_available()
    if why:
        pytest.skip(why)
    rw = tmp_path / "writable"  # the pods' emptyDir + storage volume
    (rw / "tmp").mkdir(parents=True)
    cfg = tiny_local(
        BT,
        **{"scheduler.policy": "dualpath", "storage.path": str(rw / "kv"), "storage.snicGbps": 8},
    )
    cfg_file = write_config(cfg, rw / "cluster.yaml")
    up = [sys.executable, "-m", "dualpath.cli", "up", "-f", str(cfg_file)]
    up += ["--run-dir", str(rw / "run"), "--grace", "3"]
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", READ_ONLY_ROOT, "sh", *up],
        env={**os.environ, "RW": str(rw), "TMPDIR": str(rw / "tmp")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (lines and "READY up" in lines[-1]):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "dualpath up exited:\n" + "".join(lines[-40:])
            lines.append(line)
        frontend = lines[-1].split("frontend=", 1)[1].split()[0]
        model = cfg.spec.model.name
        first = [4 + (i * 37) % 250 for i in range(160)]
        with httpx.Client(base_url=frontend, timeout=120) as c:
            body = {"model": model, "prompt": first, "max_tokens": 4, "session_id": "ro"}
            turn1 = c.post("/v1/completions", json=body)
            assert turn1.status_code == 200, turn1.text
            text = turn1.json()["dualpath"]["token_ids"]
            body["prompt"] = first + text + [4 + i for i in range(20)]
            turn2 = c.post("/v1/completions", json=body)
            assert turn2.status_code == 200, turn2.text
        assert (
            turn2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            >= (len(first) // BT) * BT
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log = proc.stdout.read() if proc.stdout else ""
    errors = [ln for ln in [*lines, *log.splitlines()] if "Read-only file system" in ln]
    assert not errors, errors[:5]
    assert any((rw / "kv").rglob("*")), "the workers stored no blocks"
