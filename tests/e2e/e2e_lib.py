"""Helpers of the opt-in e2e test: named steps, kubectl that shows its stderr, waits that say
what they last saw, the example shrunk to fit a cluster without GPUs, the bad inputs.

Pure enough to be unit-tested without a cluster (tests/unit/operator/test_e2e_lib.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


class StepFailed(AssertionError):
    """A failed e2e step: its name, and what the command or the wait saw."""


_current_step: list[str] = []


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Every failure inside names the step it happened in."""
    _current_step.append(name)
    try:
        yield
    except StepFailed:
        raise
    except AssertionError as err:
        raise StepFailed(f"step {name!r} failed: {err}") from err
    finally:
        _current_step.pop()


def _where() -> str:
    return f"step {_current_step[-1]!r}" if _current_step else "setup"


def run(
    cmd: list[str], *, input: str | None = None, check: bool = True, timeout_s: float = 120
) -> subprocess.CompletedProcess:
    """Run a command (kubectl, helm); on failure raise naming the step, the command, its exit
    status, stderr and stdout, which are otherwise captured and lost."""
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, input=input, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as err:
        raise StepFailed(f"{_where()}: `{' '.join(cmd)}` timed out after {timeout_s} s") from err
    if check and res.returncode != 0:
        raise StepFailed(
            f"{_where()}: `{' '.join(cmd)}` exited {res.returncode}\n"
            f"--- stderr ---\n{res.stderr.strip()}\n--- stdout ---\n{res.stdout.strip()[-2000:]}"
        )
    return res


def wait_for(
    what: str,
    fn: Callable[[], Any],
    timeout_s: float = 180,
    interval_s: float = 2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """Poll `fn` until it returns something truthy; on timeout say what it returned last."""
    deadline = clock() + timeout_s
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if clock() >= deadline:
            raise StepFailed(f"{_where()}: timed out after {timeout_s} s waiting for {what}")
        sleep(interval_s)


def get_json(kubectl: str, kind: str, name: str, ns: str) -> dict | None:
    res = run([kubectl, "get", kind, name, "-n", ns, "-o", "json"], check=False)
    if res.returncode != 0:
        if "NotFound" in res.stderr or "not found" in res.stderr:
            return None
        raise StepFailed(f"{_where()}: kubectl get {kind}/{name} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def condition(obj: dict | None, ctype: str) -> dict | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def shrink_example(cr: dict, namespace: str, name: str | None = None) -> dict:
    """The example, small enough for a cluster without GPUs, RDMA or a shared volume."""
    cr = copy.deepcopy(cr)
    cr["metadata"]["namespace"] = namespace
    if name:
        cr["metadata"]["name"] = name
    spec = cr["spec"]
    for role in ("prefill", "decode"):
        spec[role].update(replicas=1, gpusPerPod=0, resources={}, nodeSelector={}, tolerations=[])
    spec["network"]["rdma"]["count"] = 0
    spec["network"]["multusNetworks"] = []
    spec["storage"].pop("volume", None)
    spec["frontend"]["replicas"] = 1
    return cr


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(cr: dict) -> None:
        node = cr
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _rename(name: str) -> Callable[[dict], None]:
    return lambda cr: cr["metadata"].__setitem__("name", name)


# Each must be refused at admission or end Degraded with a reason naming the child/field.
BAD_INPUTS: list[tuple[str, Callable[[dict], None]]] = [
    ("cpu-lots", _set("spec.prefill.resources", {"requests": {"cpu": "lots"}})),
    ("bogus-volume", _set("spec.storage.volume", {"bogusSource": {"path": "/x"}})),
    ("scheduler-port-9090", _set("spec.scheduler.port", 9090)),
    ("empty-image", _set("spec.model.image", "")),
    ("name-74-chars", _rename("a" * 74)),
    ("dotted-name", _rename("agents.v2")),
]


@dataclass(frozen=True)
class BadInputOutcome:
    how: str  # "refused" (at admission) or "degraded" (by the operator)
    message: str


def bad_input_outcome(
    apply: subprocess.CompletedProcess, cr_now: dict | None
) -> BadInputOutcome | None:
    """What became of a bad input: refused by the API server (kubectl failed with a message),
    or Degraded=True with a reason and message; None while neither has happened yet."""
    if apply.returncode != 0:
        return BadInputOutcome("refused", apply.stderr.strip())
    degraded = condition(cr_now, "Degraded")
    if degraded and degraded.get("status") == "True":
        reason = degraded.get("reason", "")
        if reason in ("ApplyFailed", "InvalidSpec"):
            return BadInputOutcome("degraded", f"{reason}: {degraded.get('message', '')}")
    return None


@dataclass(frozen=True)
class StormPlan:
    values: list[int]
    kill_before: tuple[int, int]  # the operator is killed before these scales ...
    restart_before: tuple[int, int]  # ... and started again before these


def storm_plan(seed: int, scales: int = 50, low: int = 1, high: int = 4) -> StormPlan:
    """50 scale values (consecutive ones differ), two kill/restart windows in the middle."""
    rng = random.Random(seed)
    values: list[int] = []
    while len(values) < scales:
        v = rng.randint(low, high)
        if not values or v != values[-1]:
            values.append(v)
    k1 = rng.randint(scales // 5, scales // 3)
    k2 = rng.randint(scales // 2, 2 * scales // 3)
    return StormPlan(values, (k1, k2), (k1 + rng.randint(2, 5), k2 + rng.randint(2, 5)))


def documented_commands(doc: str, section: str, tool: str) -> list[list[str]]:
    """The `tool ...` lines of the first ```bash block under `## section` of a markdown doc, as
    argv lists: the e2e runs what the doc tells a user to run, not a copy of it."""
    lines = doc.splitlines()
    try:
        start = lines.index(f"## {section}")
    except ValueError:
        raise StepFailed(f"no '## {section}' section in the doc") from None
    commands, in_block = [], False
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.strip().startswith("```"):
            if in_block:
                break
            in_block = line.strip() == "```bash"
            continue
        if in_block and line.split()[:1] == [tool]:
            commands.append(shlex.split(line.split(" #", 1)[0]))
    if not commands:
        raise StepFailed(f"no `{tool}` command in the doc's '## {section}' bash block")
    return commands


def schedulable_nodes(nodes: dict) -> tuple[list[str], str]:
    """The nodes a pod can land on (Ready, not cordoned, no NoSchedule/NoExecute taint), and,
    when there is none, why: the reason the live e2e is skipped with."""
    names, why = [], []
    for node in nodes.get("items") or []:
        name = node["metadata"]["name"]
        ready = condition(node, "Ready")
        taints = [
            t["key"]
            for t in (node.get("spec") or {}).get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute")
        ]
        if not ready or ready.get("status") != "True":
            why.append(f"{name} not Ready")
        elif (node.get("spec") or {}).get("unschedulable"):
            why.append(f"{name} cordoned")
        elif taints:
            why.append(f"{name} tainted {','.join(taints)}")
        else:
            names.append(name)
    if names:
        return names, ""
    return [], "no schedulable node" + (
        f" ({'; '.join(why)})" if why else " (the cluster has none)"
    )


def split_image(image: str) -> tuple[str, str]:
    """`registry/name:tag` -> (repository, tag), as the chart's `image.*` values take it; a
    port in the registry (`host:5000/name`) is no tag."""
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, "latest"
    return repo, tag


def selector_matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against a pod's labels, as the API
    server and a NetworkPolicy implementation evaluate it; `{}` selects every pod."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def policy_admits(
    policy: dict, src_labels: dict[str, str], dst_labels: dict[str, str], port: int
) -> bool:
    """Whether a NetworkPolicy lets a pod of the policy's namespace with `src_labels` reach a
    pod with `dst_labels` on TCP `port` (podSelector peers only: the paths between pods of one
    namespace; a rule without ports allows every port)."""
    spec = policy["spec"]
    if not selector_matches(spec.get("podSelector"), dst_labels):
        return False
    for rule in spec.get("ingress") or []:
        ports = [p.get("port") for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or []:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                if selector_matches(peer["podSelector"], src_labels):
                    return True
    return False
