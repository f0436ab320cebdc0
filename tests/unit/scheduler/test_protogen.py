"""The committed gRPC stubs are what `make proto` generates from proto/.

What is compared is what the stubs carry (the messages, the services, their Python surface), not
the generator's version stamps: a grpcio-tools release that writes another version number into
the same stubs is not a stale stub. The generator itself is pinned by requirements.lock, and the
stamps the committed stubs do carry must be satisfied by the runtime the lock installs (the stubs
refuse to import otherwise).
"""

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from dualpath import protogen
from google.protobuf import __version__ as protobuf_version

COMMITTED = protogen.OUT_DIR / "dualpath" / "v1"

# The lines that name the generator's version, and nothing else.
STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = '.*'$", re.M),
]


def without_stamps(text: str) -> str:
    for stamp in STAMPS:
        text = stamp.sub("<version stamp>", text)
    return text


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


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
    assert sorted(p.name for p in COMMITTED.glob("*_pb2*.py*")) == [p.name for p in fresh]
    for path in fresh:
        mine = COMMITTED / path.name
        assert without_stamps(mine.read_text()) == without_stamps(path.read_text()), (
            f"{mine.name} is stale: run make proto"
        )


def test_a_changed_message_is_stale_but_a_new_version_stamp_is_not():
    text = (COMMITTED / "scheduler_pb2_grpc.py").read_text()
    restamped = re.sub(
        r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.9.9'", text
    )
    assert restamped != text and without_stamps(restamped) == without_stamps(text)
    renamed = text.replace("/dualpath.v1.Scheduler/Route", "/dualpath.v1.Scheduler/Routed")
    assert renamed != text and without_stamps(renamed) != without_stamps(text)
    pb2 = (COMMITTED / "scheduler_pb2.py").read_text()
    assert without_stamps(pb2).count("<version stamp>") == 2


@pytest.mark.parametrize("name", ["scheduler", "worker"])
def test_the_locked_runtime_satisfies_the_committed_stamps(name: str):
    grpc_stub = (COMMITTED / f"{name}_pb2_grpc.py").read_text()
    needed = re.search(r"GRPC_GENERATED_VERSION = '([^']*)'", grpc_stub).group(1)
    assert release(grpc.__version__) >= release(needed), "grpcio older than the stubs need"
    pb2 = (COMMITTED / f"{name}_pb2.py").read_text()
    needed_pb = re.search(r"# Protobuf Python Version: (\S+)", pb2).group(1)
    assert release(protobuf_version) >= release(needed_pb), "protobuf older than the stubs need"
