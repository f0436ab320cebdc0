"""Opt-in: a DualPathCluster on a real node (`make e2e-live KUBECONFIG=... IMAGE=...`).

Needs a cluster with a schedulable node that has the image (`kind load docker-image`, or
`ctr -n k8s.io images import` on a registry-less node: docs/operator.md), cluster DNS and
Service routing. Skipped with its reason when there is no such node. In order, each failure
naming its step:
1. the operator installed with `helm install` (its Deployment, ServiceAccount, RBAC), Ready;
2. the tiny-model cluster applied: scheduler, prefill, decode and frontend pods Running and
   Ready, every worker registered with the scheduler over the operator's mutual TLS (the
   scheduler's metrics, scraped from its pod), the DualPathCluster Ready with its counts; the
   NetworkPolicies' selectors checked against the live pods' labels (each allowed path);
3. serving through the frontend Service (`kubectl port-forward`): a chat completion; the same
   long conversation twice, the second with `cached_tokens` > 0 and its read path counted in
   the workers' metrics; a bench-style trace with both read paths taken;
4. live operations under traffic, judged against reference answers (greedy, so a wrong token is
   a wrong answer): `kubectl scale dualpathpool/<decode> --replicas=3` (the new pod registers
   and gets routes), back to 2 (the pod drains first), `kubectl delete pod` on a decode pod,
   then on the prefill pod (requests recover, 0 wrong answers), a spec change that rolls the
   pods (the scheduler pairs same-version nodes only: 0 wrong answers; the port-forward
   follows the frontend to its new pod, its gaps counted);
5. with `VLLM_IMAGE=...` (the `make image ENGINE=vllm` build on the node), a vLLM-engine
   cluster beside it: its checkpoint written onto a volume by a Job in that image, the vLLM
   prefill and decode pods Ready and registered, and the same prompt twice through its frontend,
   the second with `cached_tokens` > 0 and the same answer; skipped, with its reason, without it;
6. `helm uninstall` and the namespace deletion leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from e2e_lib import (  # noqa: E402
    StepFailed,
    condition,
    get_json,
    policy_admits,
    run,
    schedulable_nodes,
    split_image,
    step,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = os.environ.get("KUBECTL", str(ROOT / ".tools" / "bin" / "kubectl"))
HELM = os.environ.get("HELM", str(ROOT / ".tools" / "bin" / "helm"))
IMAGE = os.environ.get("DUALPATH_IMAGE", "")
VLLM_IMAGE = os.environ.get("DUALPATH_VLLM_IMAGE", "")  # optional: the ENGINE=vllm build
NAME = "live"
VLLM_NAME = "live-vllm"
# the node's storage for the KV blocks every worker shares (one node: a hostPath; a cluster of
# several nodes: DUALPATH_E2E_STORAGE_VOLUME, a JSON volume source every node can mount)
STORAGE_VOLUME = os.environ.get("DUALPATH_E2E_STORAGE_VOLUME", "")
# the vLLM step's checkpoint volume on a cluster of several nodes (a JSON volume source)
MODEL_VOLUME = os.environ.get("DUALPATH_E2E_MODEL_VOLUME", "")
POD_READY_S = float(os.environ.get("DUALPATH_E2E_POD_READY_S", "600"))

pytestmark = [
    pytest.mark.e2e_live,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or os.environ.get("DUALPATH_E2E_LIVE") != "1",
        reason="needs a cluster with a node: make e2e-live KUBECONFIG=... IMAGE=...",
    ),
]


def kubectl(*args, check=True, input=None, timeout_s=120):
    return run([KUBECTL, *args], check=check, input=input, timeout_s=timeout_s)


class Live:
    """What the steps share: the namespace, the Helm release, the port-forward."""

    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.ns = f"dualpath-live-{suffix}"
        self.release = f"dualpath-live-{suffix}"
        self.base = ""  # the frontend's URL through the port-forward
        self.forward: PortForward | None = None
        self.refs: dict[int, tuple[list[int], str]] = {}


@pytest.fixture(scope="module")
def live():
    if not IMAGE:
        pytest.skip("IMAGE=... names the DualPath image the node has (make e2e-live IMAGE=...)")
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)
    names, why = schedulable_nodes(nodes)
    if not names:
        pytest.skip(f"{why}: the live e2e needs a node to run the pods on")
    state = Live()
    yield state
    if state.forward is not None:
        state.forward.terminate()
    # a failed step leaves no release or namespace behind
    run([HELM, "uninstall", state.release, "-n", state.ns, "--wait"], check=False, timeout_s=300)
    kubectl("delete", "namespace", state.ns, "--ignore-not-found", "--wait=false", check=False)


def node_volume(ns: str, what: str, shared: bool = True) -> dict:
    """A volume every worker pod shares: the one of DUALPATH_E2E_STORAGE_VOLUME (a cluster of
    several nodes), else a hostPath on the one node, one directory per namespace and use."""
    if STORAGE_VOLUME and shared:
        return json.loads(STORAGE_VOLUME)
    return {"hostPath": {"path": f"/var/lib/dualpath-e2e/{ns}/{what}", "type": "DirectoryOrCreate"}}


def cluster_cr(ns: str, **spec_changes) -> dict:
    """The tiny model on CPU: 1 prefill, 2 decode, 1 frontend, mutual TLS (the default)."""
    storage_volume = node_volume(ns, "kv")
    spec = {
        "model": {"preset": "tiny", "image": IMAGE, "blockTokens": 16},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "frontend": {"replicas": 1},
        "storage": {"path": "/var/lib/dualpath/kv", "volume": storage_volume},
        # no RDMA device plugin on a plain node: UCX over TCP and shared memory
        "network": {"rdma": {"count": 0}},
        # a hostPath is created root-owned: the workers write their blocks there as root
        "workers": {"runAsNonRoot": False, "startupSeconds": 300},
    }
    for key, value in spec_changes.items():
        spec[key] = {**spec.get(key, {}), **value}
    return {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": spec,
    }


def pods(ns: str, component: str | None = None, name: str = NAME) -> list[dict]:
    sel = f"app.kubernetes.io/instance={name}"
    if component:
        sel += f",app.kubernetes.io/component={component}"
    return json.loads(kubectl("get", "pods", "-n", ns, "-l", sel, "-o", "json").stdout)["items"]


def pod_ready(pod: dict) -> bool:
    c = condition(pod, "Ready")
    return bool(c and c.get("status") == "True" and not pod["metadata"].get("deletionTimestamp"))


def scrape(ns: str, pod: str, port: int | str) -> str:
    """A pod's /metrics through the API server's pod proxy (which takes a port number only:
    a port's name is looked up in the pod's spec)."""
    if isinstance(port, str) and not port.isdigit():
        spec = get_json(KUBECTL, "pod", pod, ns)["spec"]
        port = next(
            p["containerPort"]
            for c in spec["containers"]
            for p in c.get("ports") or []
            if p.get("name") == port
        )
    path = f"/api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy/metrics"
    return kubectl("get", "--raw", path).stdout


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def healthy_nodes(ns: str, name: str = NAME) -> set[str]:
    sched = pods(ns, "scheduler", name)[0]["metadata"]["name"]
    text = scrape(ns, sched, "metrics")
    return {
        m.group(1)
        for m in re.finditer(
            r'^dualpath_scheduler_node_healthy\{node="([^"]+)"\} 1\.0$', text, re.M
        )
    }


class PortForward:
    """`kubectl port-forward svc/<cluster>-frontend` on one local port, started again whenever
    it exits: it follows one pod, and a rollout deletes that pod (a client of the Service in
    the cluster would go to the next Ready pod). `restarts` counts the gaps."""

    def __init__(self, ns: str, name: str) -> None:
        svc = json.loads(kubectl("get", "svc", f"{name}-frontend", "-n", ns, "-o", "json").stdout)
        self.cmd = [KUBECTL, "port-forward", "-n", ns, f"svc/{name}-frontend"]
        self.remote = svc["spec"]["ports"][0]["port"]
        self.restarts = 0
        self._stop = threading.Event()
        self.proc, line = self._start(f":{self.remote}")
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not m:
            self.proc.terminate()
            raise StepFailed(f"kubectl port-forward said: {line!r}")
        self.local = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.local}"
        threading.Thread(target=self._follow, daemon=True).start()

    def _start(self, ports: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [*self.cmd, ports], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        line = proc.stdout.readline()
        # keep reading its output so the pipe never fills
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        return proc, line

    def _follow(self) -> None:
        while not self._stop.is_set():
            self.proc.wait()
            while not self._stop.is_set():
                self.restarts += 1
                time.sleep(0.5)
                proc, line = self._start(f"{self.local}:{self.remote}")
                if self._stop.is_set():  # terminated while it started: no forward outlives us
                    proc.terminate()
                    return
                if "Forwarding from" in line:
                    self.proc = proc
                    break
                proc.terminate()

    def terminate(self) -> None:
        self._stop.set()
        self.proc.terminate()
        self.proc.wait(timeout=10)


def forward(live: Live, name: str = NAME) -> None:
    """Forward a free local port to the cluster's frontend Service (`PortForward`)."""
    if live.forward is not None:
        live.forward.terminate()
    live.forward = PortForward(live.ns, name)
    live.base = live.forward.base


def completion(
    base: str, prompt: list[int], max_tokens: int = 8, model: str = "dualpath-tiny"
) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
    return r.json()


def prompt_ids(i: int, n: int = 96) -> list[int]:
    from dualpath.local.faults.client import prompt_ids as ids

    return ids(i, n)


class Traffic:
    """Clients sending turns in a thread while a step acts on the cluster; every answer judged
    against the reference answer of its prompt (learnt on the healthy cluster)."""

    def __init__(self, live: Live, prompts: range, concurrency: int = 3) -> None:
        self.live, self.prompts, self.concurrency = live, prompts, concurrency
        self.results: list = []
        self.error: BaseException | None = None  # what stopped the clients' thread, if anything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as err:  # noqa: BLE001 -- handed to the waiting step
            self.error = err
            raise

    async def _run(self) -> None:
        from dualpath.local.faults.client import Client

        # one client per frontend URL: a rollout moves the port-forward to the new frontend pod
        clients: dict[str, Client] = {}

        def client() -> Client:
            base = self.live.base
            if base not in clients:
                clients[base] = Client(base, "dualpath-tiny", deadline_s=120)
                clients[base].refs = self.live.refs
            return clients[base]

        async def one(k: int) -> None:
            i = k
            while not self._stop.is_set():
                res = await client().turn(self.prompts[i % len(self.prompts)], stream=k % 2 == 1)
                self.results.append(res)
                if res.kind != "ok":
                    await asyncio.sleep(1)  # a refused turn: the client backs off, then retries
                i += self.concurrency

        try:
            await asyncio.gather(*(one(k) for k in range(self.concurrency)))
        finally:
            for c in clients.values():
                await c.close()

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def summary(self) -> Counter:
        out = Counter(r.kind for r in self.results)
        out["wrong"] = sum(r.wrong for r in self.results)
        return out

    def why_not_ok(self) -> Counter:
        """The turns not answered, by status and error (a refusal, a lost connection...)."""
        return Counter(
            f"{r.kind} {r.status or ''} {r.error[:80]}".strip()
            for r in self.results
            if r.kind != "ok"
        )

    def wait_ok(self, n: int, timeout_s: float = 300) -> None:
        start = len(self.results)

        def answered() -> bool:
            if self.error is not None:  # the clients are gone: no turn will come
                raise StepFailed(f"the traffic's clients stopped: {self.error!r}")
            return sum(r.kind == "ok" for r in self.results[start:]) >= n

        wait_for(f"{n} answered turns", answered, timeout_s=timeout_s)


# A plaintext gRPC health check from inside the scheduler's pod: refused under mutual TLS.
PLAINTEXT_CALL = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}")
try:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    print("answered")
except grpc.RpcError as err:
    print("refused", err.code())
"""


def test_1_the_operator_is_installed_with_helm(live):
    repo, tag = split_image(IMAGE)
    with step("helm install the chart (the operator's Deployment, ServiceAccount, RBAC)"):
        run(
            [
                HELM,
                "install",
                live.release,
                str(ROOT / "charts" / "dualpath"),
                "-n",
                live.ns,
                "--create-namespace",
                "--set",
                f"image.repository={repo}",
                "--set",
                f"image.tag={tag}",
                "--set",
                f"operator.watchNamespaces={{{live.ns}}}",
                "--wait",
                "--timeout=5m",
            ],
            timeout_s=360,
        )
    with step("the operator pod is Running and Ready"):
        sel = f"app.kubernetes.io/instance={live.release}"
        got = json.loads(kubectl("get", "pods", "-n", live.ns, "-l", sel, "-o", "json").stdout)
        assert [pod_ready(p) for p in got["items"]] == [True], got["items"]
        for kind in ("serviceaccount", "deployment"):
            assert kubectl("get", kind, "-n", live.ns, "-l", sel, "-o", "name").stdout.strip()


def test_2_the_tiny_cluster_runs_every_pod_ready_and_registered(live):
    with step("apply the tiny-model DualPathCluster"):
        applied = time.monotonic()
        kubectl("apply", "-f", "-", input=yaml.safe_dump(cluster_cr(live.ns)))
    with step("scheduler, prefill, decode and frontend pods Running and Ready"):
        want = {"scheduler": 1, "prefill": 1, "decode": 2, "frontend": 1}

        def ready_counts():
            got = Counter(
                p["metadata"]["labels"]["app.kubernetes.io/component"]
                for p in pods(live.ns)
                if pod_ready(p)
            )
            return dict(got) == want and got

        wait_for(f"ready pods {want}", ready_counts, timeout_s=POD_READY_S, interval_s=5)
        print(f"pods Ready {time.monotonic() - applied:.0f} s after the apply (polled every 5 s)")
        print(kubectl("get", "pods", "-n", live.ns, "-o", "wide").stdout)
    with step("every worker registered with the scheduler (its metrics)"):
        workers = {p["metadata"]["name"] for c in ("prefill", "decode") for p in pods(live.ns, c)}
        wait_for(
            f"the scheduler's healthy nodes == {sorted(workers)}",
            lambda: healthy_nodes(live.ns) == workers,
            timeout_s=120,
        )
        for name in sorted(workers):
            log = kubectl("logs", "-n", live.ns, name).stdout
            assert "with the scheduler" in log and "registered" in log, log[-3000:]
    with step("over mutual TLS: the scheduler refuses a plaintext call"):
        cm = get_json(KUBECTL, "configmap", f"{NAME}-config", live.ns)
        assert "mode: mtls" in cm["data"]["cluster.yaml"], cm["data"]["cluster.yaml"]
        sched = pods(live.ns, "scheduler")[0]["metadata"]["name"]
        port = get_json(KUBECTL, "dpc", NAME, live.ns)["spec"]["scheduler"]["port"]
        out = kubectl("exec", "-n", live.ns, sched, "--", "python", "-c", PLAINTEXT_CALL, str(port))
        assert out.stdout.strip().startswith("refused"), out.stdout
    with step("the DualPathCluster is Ready with its counts"):
        wait_for(
            "Ready=True",
            lambda: (
                (condition(get_json(KUBECTL, "dpc", NAME, live.ns), "Ready") or {}).get("status")
                == "True"
            ),
            timeout_s=180,
        )
        st = get_json(KUBECTL, "dpc", NAME, live.ns)["status"]
        assert st["prefill"]["readyReplicas"] == 1 and st["decode"]["readyReplicas"] == 2, st
        print(kubectl("get", "dpc,dpp", "-n", live.ns).stdout)


def test_3_the_network_policies_select_the_live_pods_on_each_allowed_path(live):
    """A bridge CNI enforces no NetworkPolicy: what is checked is that each path the cluster
    needs is allowed by the policies' selectors as the live pods are labelled."""
    policies = json.loads(kubectl("get", "networkpolicy", "-n", live.ns, "-o", "json").stdout)
    by_name = {p["metadata"]["name"]: p for p in policies["items"]}
    labels = {c: pods(live.ns, c)[0]["metadata"]["labels"] for c in ("scheduler", "frontend")}
    labels |= {c: pods(live.ns, c)[0]["metadata"]["labels"] for c in ("prefill", "decode")}
    sched = get_json(KUBECTL, "dpc", NAME, live.ns)["spec"]["scheduler"]["port"]
    fe_port = get_json(KUBECTL, "svc", f"{NAME}-frontend", live.ns)["spec"]["ports"][0]["port"]
    paths = [
        ("scheduler", "frontend", "scheduler", sched),
        ("scheduler", "prefill", "scheduler", sched),
        ("scheduler", "decode", "scheduler", sched),
        ("workers", "scheduler", "prefill", 50061),
        ("workers", "frontend", "decode", 50061),
        ("workers", "prefill", "decode", 50061),
        ("workers", "decode", "prefill", 40000),  # UCX: any port between workers
        ("frontend", "frontend", "frontend", fe_port),  # a pod of the namespace
    ]
    with step("each allowed path matches the live pods' labels"):
        for policy, src, dst, port in paths:
            pol = by_name[f"{NAME}-{policy}"]
            assert policy_admits(pol, labels[src], labels[dst], port), (policy, src, dst, port)
        # and a path no policy allows stays closed: the frontend does not reach the workers' UCX
        assert not policy_admits(
            by_name[f"{NAME}-workers"], labels["frontend"], labels["decode"], 40000
        )


def test_4_serving_through_the_frontend_service(live):
    with step("kubectl port-forward svc/live-frontend"):
        forward(live)
    with step("a chat completion"):
        body = {
            "model": "dualpath-tiny",
            "messages": [{"role": "user", "content": "Hello from the live e2e."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"]["role"] == "assistant", out
        print("chat:", json.dumps(out)[:600])
    with step("the same long conversation twice: the second reads its cached prefix"):
        before = {
            p["metadata"]["name"]: scrape(live.ns, p["metadata"]["name"], "metrics")
            for c in ("prefill", "decode")
            for p in pods(live.ns, c)
        }
        conversation = [
            {"role": "system", "content": "You are a careful agent. " * 20},
            {"role": "user", "content": "Plan the next step of the task. " * 20},
        ]
        body = {"model": "dualpath-tiny", "messages": conversation, "max_tokens": 8}
        body["temperature"] = 0
        first = httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=120).json()
        second = httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=120).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(
            f"turn 1 cached_tokens={first['usage']['prompt_tokens_details']['cached_tokens']}, "
            f"turn 2 cached_tokens={cached} of {second['usage']['prompt_tokens']}, read path "
            f"{second['dualpath']['read_path']}"
        )
        assert cached > 0, second
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        path = second["dualpath"]["read_path"]
        assert path in ("prefill", "decode"), second["dualpath"]
        hits = 0.0
        for name, text in before.items():
            now = scrape(live.ns, name, "metrics")
            hits += metric(now, "dualpath_worker_hit_bytes_total", path=path) - metric(
                text, "dualpath_worker_hit_bytes_total", path=path
            )
        assert hits > 0, f"no dualpath_worker_hit_bytes_total{{path={path!r}}} on the pods"
        print(f"read path {path}: {hits:.0f} hit bytes counted in the workers' metrics")
    with step("a bench-style trace through the cluster takes both read paths"):
        from dualpath.local.bench import Progress, replay
        from dualpath.trace import TraceSpec, generate

        spec = TraceSpec(
            agents=6,
            max_context_tokens=2048,
            max_turns=4,
            mean_append_tokens=64,
            mean_gen_tokens=8,
            first_tokens=256,
            mean_think_s=0.0,
            seed=7,
        )

        async def go():
            async with httpx.AsyncClient(base_url=live.base, timeout=300) as client:
                return await replay(
                    client, generate(spec), "dualpath-tiny", 512, progress=Progress(0, "", False)
                )

        results = asyncio.run(go())
        paths = Counter(r.read_path for r in results if r.ok and r.cached_tokens > 0)
        failed = [r.error for r in results if not r.ok]
        print(f"trace: {len(results)} turns, hits by read path {dict(paths)}, failed {failed}")
        assert not failed, failed
        assert paths["prefill"] > 0 and paths["decode"] > 0, paths
    with step("reference answers on the healthy cluster"):
        for i in range(12):
            out = completion(live.base, prompt_ids(i))
            live.refs[i] = (out["dualpath"]["token_ids"], out["choices"][0]["text"])


def test_5_scale_decode_up_then_down_under_traffic(live):
    with Traffic(live, range(12)) as traffic:
        traffic.wait_ok(6)
        with step("kubectl scale dualpathpool/live-decode --replicas=3"):
            kubectl("scale", f"dualpathpool/{NAME}-decode", "-n", live.ns, "--replicas=3")
            wait_for(
                "live-decode-2 Ready",
                lambda: any(
                    p["metadata"]["name"] == f"{NAME}-decode-2" and pod_ready(p)
                    for p in pods(live.ns, "decode")
                ),
                timeout_s=POD_READY_S,
                interval_s=5,
            )
        with step("the new pod registers and receives routes"):
            wait_for(
                "live-decode-2 healthy in the scheduler",
                lambda: f"{NAME}-decode-2" in healthy_nodes(live.ns),
                timeout_s=120,
            )
            wait_for(
                "a turn decoded on live-decode-2",
                lambda: any(r.decode_node == f"{NAME}-decode-2" for r in traffic.results),
                timeout_s=180,
            )
        with step("scale back to 2: the pod drains, in-flight turns finish"):
            kubectl("scale", f"dualpathpool/{NAME}-decode", "-n", live.ns, "--replicas=2")
            wait_for(
                "live-decode-2 gone",
                lambda: all(p["metadata"]["name"] != f"{NAME}-decode-2" for p in pods(live.ns)),
                timeout_s=300,
                interval_s=2,
            )
            traffic.wait_ok(6)
    summary = traffic.summary()
    print("scale up/down traffic:", dict(summary), "not answered:", dict(traffic.why_not_ok()))
    assert summary["wrong"] == 0 and summary["lost"] == 0 and summary["hung"] == 0, summary
    assert summary["failed"] == 0, [r.error for r in traffic.results if r.kind == "failed"]


def test_6_pod_kills_during_traffic_recover_with_no_wrong_answer(live):
    with Traffic(live, range(12)) as traffic:
        traffic.wait_ok(6)
        for pod in (f"{NAME}-decode-0", f"{NAME}-prefill-0"):
            with step(f"kubectl delete pod {pod} during traffic"):
                uid = get_json(KUBECTL, "pod", pod, live.ns)["metadata"]["uid"]
                kubectl("delete", "pod", pod, "-n", live.ns, "--wait=false")
                wait_for(
                    f"{pod} back (a new pod) and Ready",
                    lambda pod=pod, uid=uid: (
                        (p := get_json(KUBECTL, "pod", pod, live.ns))
                        and p["metadata"]["uid"] != uid
                        and pod_ready(p)
                    ),
                    timeout_s=POD_READY_S,
                    interval_s=3,
                )
            with step(f"requests recover after {pod}"):
                traffic.wait_ok(6, timeout_s=300)
    summary = traffic.summary()
    print("pod kills traffic:", dict(summary), "not answered:", dict(traffic.why_not_ok()))
    assert summary["wrong"] == 0, [r.error for r in traffic.results if r.wrong]
    assert summary["hung"] == 0 and summary["lost"] == 0, summary


def test_7_a_spec_change_rolls_the_pods_pairing_same_versions(live):
    old_hash = get_json(KUBECTL, "dpc", NAME, live.ns)["status"]["configHash"]
    with Traffic(live, range(12)) as traffic:
        traffic.wait_ok(6)
        with step("change the spec (scheduler.shortReadQueueSeconds): a new config hash"):
            cr = cluster_cr(live.ns, scheduler={"shortReadQueueSeconds": 4})
            kubectl("apply", "-f", "-", input=yaml.safe_dump(cr))
            new_hash = wait_for(
                "a new status.configHash",
                lambda: (
                    (h := get_json(KUBECTL, "dpc", NAME, live.ns)["status"].get("configHash"))
                    != old_hash
                    and h
                ),
                timeout_s=120,
            )
        with step("every pod rolled to the new hash, the cluster Ready again"):

            def rolled():
                ps = pods(live.ns)
                hashes = {
                    p["metadata"]["annotations"].get("dualpath.io/config-hash")
                    for p in ps
                    if not p["metadata"].get("deletionTimestamp")
                }
                ready = Counter(
                    p["metadata"]["labels"]["app.kubernetes.io/component"]
                    for p in ps
                    if pod_ready(p)
                )
                return hashes == {new_hash} and ready == Counter(
                    scheduler=1, prefill=1, decode=2, frontend=1
                )

            wait_for("pods on the new hash and Ready", rolled, timeout_s=POD_READY_S * 2)
            wait_for(
                "Ready=True",
                lambda: (
                    (condition(get_json(KUBECTL, "dpc", NAME, live.ns), "Ready") or {}).get(
                        "status"
                    )
                    == "True"
                ),
                timeout_s=180,
            )
        # the frontend pod rolled too: the port-forward followed it to the new one
        traffic.live = live
        traffic.wait_ok(6, timeout_s=300)
    summary = traffic.summary()
    gaps = live.forward.restarts
    print(
        "rollout traffic:",
        dict(summary),
        "not answered:",
        dict(traffic.why_not_ok()),
        f"port-forward restarts: {gaps}",
    )
    assert summary["wrong"] == 0, [r.error for r in traffic.results if r.wrong]


def vllm_cluster_cr(ns: str, checkpoint: str, model_volume: dict) -> dict:
    """The vLLM engine's smallest cluster: tiny64 (a head dim vLLM's CPU attention takes), 1
    prefill and 1 decode serving on `vllm serve` children, in the ENGINE=vllm image."""
    cr = cluster_cr(
        ns,
        model={"preset": "tiny64", "checkpointPath": checkpoint, "volume": model_volume},
        decode={"replicas": 1},
        storage={"volume": node_volume(ns, "kv-vllm")},
        workers={
            "engine": "vllm",
            "startupSeconds": 900,  # vLLM loads and warms up on CPU
            "vllm": {"image": VLLM_IMAGE, "cacheBytes": 2 * 1024**3},
        },
    )
    cr["spec"]["model"].pop("blockTokens")  # vLLM's block is 2 store blocks of the default
    cr["metadata"]["name"] = VLLM_NAME
    return cr


def model_writer_job(ns: str, checkpoint: str, model_volume: dict) -> dict:
    """A Job in the vLLM image writing the tiny64 checkpoint onto the model volume (what a team
    does with its own weights: put them on a volume the pods mount)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{VLLM_NAME}-model", "namespace": ns},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "write",
                            "image": VLLM_IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "args": ["model", "write", "--preset", "tiny64", "--out", checkpoint],
                            # a hostPath is created root-owned
                            "securityContext": {"runAsUser": 0},
                            # the volume's root is the checkpoint, as the pods mount it
                            "volumeMounts": [{"name": "model", "mountPath": checkpoint}],
                        }
                    ],
                    "volumes": [{"name": "model", **model_volume}],
                }
            },
        },
    }


def test_8_a_vllm_cluster_serves_from_the_vllm_image(live):
    if not VLLM_IMAGE:
        pytest.skip(
            "VLLM_IMAGE=... names the ENGINE=vllm image the node has (make image ENGINE=vllm)"
        )
    checkpoint = "/models/tiny64"
    model_volume = (
        json.loads(MODEL_VOLUME) if MODEL_VOLUME else node_volume(live.ns, "model", shared=False)
    )
    with step("write the tiny64 checkpoint onto the model volume (a Job in the vLLM image)"):
        job = model_writer_job(live.ns, checkpoint, model_volume)
        kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
        kubectl(
            "wait",
            "--for=condition=complete",
            f"job/{VLLM_NAME}-model",
            "-n",
            live.ns,
            f"--timeout={int(POD_READY_S)}s",
            timeout_s=POD_READY_S + 30,
        )
    with step("apply the vLLM DualPathCluster: its prefill and decode pods Ready, registered"):
        kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump(vllm_cluster_cr(live.ns, checkpoint, model_volume)),
        )
        want = {"scheduler": 1, "prefill": 1, "decode": 1, "frontend": 1}

        def ready_counts():
            got = Counter(
                p["metadata"]["labels"]["app.kubernetes.io/component"]
                for p in pods(live.ns, name=VLLM_NAME)
                if pod_ready(p)
            )
            return dict(got) == want and got

        wait_for(f"ready vLLM pods {want}", ready_counts, timeout_s=POD_READY_S, interval_s=5)
        workers = {
            p["metadata"]["name"]
            for c in ("prefill", "decode")
            for p in pods(live.ns, c, VLLM_NAME)
        }
        for w in workers:
            image = get_json(KUBECTL, "pod", w, live.ns)["spec"]["containers"][0]["image"]
            assert image == VLLM_IMAGE, (w, image)
        wait_for(
            f"the scheduler's healthy nodes == {sorted(workers)}",
            lambda: healthy_nodes(live.ns, VLLM_NAME) == workers,
            timeout_s=120,
        )
        print(
            kubectl(
                "get", "pods", "-n", live.ns, "-l", f"app.kubernetes.io/instance={VLLM_NAME}"
            ).stdout
        )
    with step("the same prompt twice through the vLLM cluster: the second reads its prefix"):
        forward(live, VLLM_NAME)
        prompt = prompt_ids(1000, 320)  # whole vLLM blocks: a hit is counted in whole blocks
        first = completion(live.base, prompt, model="dualpath-tiny64")
        second = completion(live.base, prompt, model="dualpath-tiny64")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(
            f"vLLM: turn 2 cached_tokens={cached} of {second['usage']['prompt_tokens']}, "
            f"read path {second['dualpath']['read_path']}, answer {second['choices'][0]['text']!r}"
        )
        assert cached > 0, second
        assert second["dualpath"]["token_ids"] == first["dualpath"]["token_ids"], (first, second)
    with step("delete the vLLM cluster: its pods go"):
        live.forward.terminate()
        live.forward = None
        kubectl("delete", "dpc", VLLM_NAME, "-n", live.ns, "--timeout=300s", timeout_s=330)
        kubectl("delete", "job", f"{VLLM_NAME}-model", "-n", live.ns, "--wait=true")
        wait_for(
            "no vLLM cluster pod left", lambda: not pods(live.ns, name=VLLM_NAME), timeout_s=300
        )


def test_9_helm_uninstall_and_namespace_deletion_leave_nothing(live):
    with step("delete the cluster, helm uninstall, delete the namespace"):
        kubectl("delete", "dpc", NAME, "-n", live.ns, "--timeout=300s", timeout_s=330)
        if live.forward is not None:
            live.forward.terminate()
            live.forward = None
        run([HELM, "uninstall", live.release, "-n", live.ns, "--wait"], timeout_s=300)
        kubectl("delete", "namespace", live.ns, "--timeout=300s", timeout_s=330)
    with step("nothing of the release or the cluster is left"):
        ns_gone = kubectl("get", "namespace", live.ns, check=False)
        assert ns_gone.returncode != 0 and "NotFound" in ns_gone.stderr, ns_gone.stdout
        for sel in (
            f"app.kubernetes.io/instance={live.release}",
            f"app.kubernetes.io/instance={NAME}",
        ):
            left = kubectl(
                "get", "clusterrole,clusterrolebinding,pods,pv", "-A", "-l", sel, "-o", "name"
            ).stdout.strip()
            assert left == "", left
        print(f"namespace {live.ns} and release {live.release}: gone; CRDs kept (helm keeps crds/)")
