"""The Grafana dashboard (charts/dualpath/dashboards/dualpath.json) queries only series a running
local cluster exports, with the labels it uses.

The queries' selectors are read by a small PromQL lexer below rather than a parser package: every
query is ours, every metric name starts with `dualpath_`, and what the check needs is the
selectors (metric name + label matchers), the grouping labels (`by`, `on`, `group_left`) and the
legend's `{{label}}`s. The lexer skips string literals, range brackets and numbers, so a label
value or a duration is never taken for a name; `test_lexer_reads_the_parts_a_check_needs` pins
what it extracts, and `test_a_wrong_query_is_caught` shows the check fails on a wrong name, label
or value.

A scrape in Kubernetes adds target labels (the PodMonitor of the chart: `namespace`, `pod`,
`instance`, `job`); the test adds the same to each process's samples. A labelled counter nobody
incremented (a failure reason that did not happen) has no series yet: its family must still be
exported, and the labels the dashboard uses must be those it is defined with.
"""

from __future__ import annotations

import io
import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "charts" / "dualpath" / "dashboards" / "dualpath.json"
TARGET_LABELS = ("namespace", "pod", "instance", "job")
VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "${namespace}": ".*"}
KEYWORDS_WITH_LABELS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATORS = {"and", "or", "unless", "bool", "offset"}
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk"}

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<range>\[[^\]]*\])
    | (?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},])
    )""",
    re.VERBOSE,
)


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)


@dataclass
class Query:
    selectors: list[Selector]
    grouping: set[str]  # labels named by by/without/on/ignoring/group_left/group_right
    legend: set[str]


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m and m.end() > pos, f"cannot lex {expr[pos:]!r} in {expr!r}"
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def parse(expr: str, legend: str = "") -> Query:
    for var, val in VARIABLES.items():
        expr = expr.replace(var, val)
    toks = _tokens(expr)
    q = Query([], set(), set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)))
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in KEYWORDS_WITH_LABELS:
            if nxt == "(":
                i += 2
                while toks[i][1] != ")":
                    if toks[i][0] == "ident":
                        q.grouping.add(toks[i][1])
                    i += 1
        elif kind == "ident" and text == "label_values" and nxt == "(":
            q.selectors.append(Selector(toks[i + 2][1]))
            q.grouping.add(toks[i + 4][1])
            i += 5
        elif kind == "ident" and text in AGGREGATIONS and nxt in ("by", "without"):
            pass  # `sum by (...) (...)`: the grouping is read at `by`
        elif kind == "ident" and nxt != "(" and text not in OPERATORS:
            sel = Selector(text)
            if nxt == "{":
                i += 2
                while toks[i][1] != "}":
                    if toks[i][1] == ",":
                        i += 1
                        continue
                    (_, label), (_, op), (vk, value) = toks[i : i + 3]
                    assert vk == "str" and op in ("=", "!=", "=~", "!~"), expr
                    sel.matchers.append(
                        (label, op, json.loads(value) if value[0] == '"' else value[1:-1])
                    )
                    i += 3
            q.selectors.append(sel)
        i += 1
    return q


def dashboard_queries(dash: dict) -> list[tuple[str, Query]]:
    """Every query of the dashboard: the panels' targets and the templating variables'."""
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            expr = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", parse(expr)))
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for p in panels:
        for t in p["targets"]:
            out.append(
                (f"{p['title']} / {t['refId']}", parse(t["expr"], t.get("legendFormat", "")))
            )
    return out


# ---- the exported series ------------------------------------------------------------------------


@dataclass
class Exported:
    samples: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # sample name -> labels
    families: set[str] = field(default_factory=set)  # every name a family declares


def scrape(urls: dict[str, str]) -> Exported:
    """Each process's /metrics, with the target labels a Kubernetes scrape would add."""
    got = Exported()
    for pod, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (local URL)
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            suffixes = {
                "counter": ("_total", "_created"),
                "histogram": ("_bucket", "_count", "_sum"),
            }
            got.families.add(fam.name)
            got.families.update(fam.name + s for s in suffixes.get(fam.type, ()))
            for s in fam.samples:
                assert not set(TARGET_LABELS) & set(s.labels), f"{s.name} shadows a target label"
                labels = {**s.labels, "namespace": "dualpath", "pod": pod, "job": "dualpath"}
                labels["instance"] = url.split("/")[2]
                got.samples.setdefault(s.name, []).append(labels)
    return got


def defined_labels(name: str) -> set[str]:
    """The label names a metric is defined with in this code (for families with no series)."""
    import dualpath.kv.metrics  # noqa: F401
    import dualpath.scheduler.metrics  # noqa: F401
    import dualpath.transfer.metrics  # noqa: F401
    import dualpath.worker.metrics  # noqa: F401

    for base in (name, name.removesuffix("_total"), re.sub(r"_(bucket|count|sum)$", "", name)):
        c = REGISTRY._names_to_collectors.get(base)  # noqa: SLF001 (no public lookup by name)
        if c is not None:
            extra = {"le"} if name.endswith("_bucket") else set()
            return set(c._labelnames) | set(TARGET_LABELS) | extra  # noqa: SLF001
    raise AssertionError(f"{name}: exported as a family but defined nowhere in dualpath")


def _matches(labels: dict[str, str], label: str, op: str, value: str) -> bool:
    have = labels.get(label, "")
    return {
        "=": have == value,
        "!=": have != value,
        "=~": re.fullmatch(value, have) is not None,
        "!~": re.fullmatch(value, have) is None,
    }[op]


def problems(queries: list[tuple[str, Query]], exported: Exported) -> list[str]:
    out = []
    for where, q in queries:
        seen_labels: set[str] = set()
        for sel in q.selectors:
            if not sel.metric.startswith("dualpath_"):
                out.append(f"{where}: {sel.metric} is not a dualpath_ metric")
                continue
            series = exported.samples.get(sel.metric)
            if series:
                names = set().union(*(set(s) for s in series))
                for label, _, _ in sel.matchers:
                    if label not in names:
                        out.append(f"{where}: {sel.metric} has no label {label!r}")
                # a negative matcher selects what did not happen here (failed outcomes): it
                # needs its label; the positive ones need a series
                pos = [m for m in sel.matchers if m[1] in ("=", "=~")]
                if not any(all(_matches(s, *m) for m in pos) for s in series):
                    out.append(f"{where}: no series of {sel.metric} matches {pos}")
            elif sel.metric in exported.families:
                names = defined_labels(sel.metric)
                for label, op, value in sel.matchers:
                    if label not in names:
                        out.append(f"{where}: {sel.metric} is defined without label {label!r}")
                    elif op in ("=", "=~") and not _matches({}, label, op, value):
                        out.append(f"{where}: {sel.metric} has no series yet for {label}={value}")
            else:
                out.append(f"{where}: no process exports {sel.metric}")
                continue
            seen_labels |= names
        for label in (q.grouping | q.legend) - seen_labels:
            out.append(f"{where}: label {label!r} is on none of its series")
    return out


# ---- the tests ----------------------------------------------------------------------------------


def test_lexer_reads_the_parts_a_check_needs() -> None:
    q = parse(
        'sum by (pod, path) (rate(dualpath_a_total{namespace=~"$namespace", path="decode"}'
        "[$__rate_interval])) / on (pod) group_left (node) dualpath_b{x!~'1|2'} > 0.5",
        "{{pod}} {{ node }}",
    )
    assert [s.metric for s in q.selectors] == ["dualpath_a_total", "dualpath_b"]
    assert q.selectors[0].matchers == [("namespace", "=~", ".*"), ("path", "=", "decode")]
    assert q.selectors[1].matchers == [("x", "!~", "1|2")]
    assert q.grouping == {"pod", "path", "node"} and q.legend == {"pod", "node"}
    lv = parse("label_values(dualpath_worker_info, namespace)")
    assert [s.metric for s in lv.selectors] == ["dualpath_worker_info"]
    assert lv.grouping == {"namespace"}


def test_a_wrong_query_is_caught() -> None:
    exported = Exported(
        samples={"dualpath_a_total": [{"path": "prefill", "pod": "p"}]},
        families={"dualpath_a_total", "dualpath_worker_recompute_fallbacks_total"},
    )
    ok = parse('sum by (pod) (rate(dualpath_a_total{path="prefill"}[1m]))', "{{pod}}")
    assert problems([("ok", ok)], exported) == []
    for bad in (
        'rate(dualpath_b_total{path="prefill"}[1m])',  # no such metric
        'rate(dualpath_a_total{route="prefill"}[1m])',  # no such label
        'rate(dualpath_a_total{path="decode"}[1m])',  # no such value
        "sum by (node) (rate(dualpath_a_total[1m]))",  # grouping label missing
        'rate(dualpath_worker_recompute_fallbacks_total{cause!="x"}[1m])',  # not in definition
    ):
        assert problems([("bad", parse(bad))], exported), bad


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs), p["title"]
    assert all(q.selectors for _, q in dashboard_queries(dash))


@pytest.mark.slow
def test_every_dashboard_series_exists_on_a_running_cluster(tmp_path: Path) -> None:
    from dualpath.local.cluster import LocalCluster
    from tiny_configs import tiny_local

    # decode-read: every hit is read by the decode node, so both paths' series exist after two
    # turns (the first turn, a miss, runs on path P's side); dualpath's choice is load-dependent
    cfg = tiny_local(
        **{
            "scheduler.policy": "decode-read",
            "storage.path": str(tmp_path / "kv"),
            "storage.snicGbps": 8,
        },
    )
    model = cfg.spec.model.name
    with LocalCluster(cfg, tmp_path / "run", sink=io.StringIO(), grace_s=3) as cl:
        ep = cl.endpoints
        with httpx.Client(base_url=ep.frontend, timeout=120) as c:
            prompt = "You are a careful agent. " * 8
            for turn in range(3):
                r = c.post(
                    "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 6, "session_id": "s"},
                )
                assert r.status_code == 200, r.text
                prompt += r.json()["choices"][0]["text"] + f" tool result {turn}: ok. " * 4
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        urls = {
            "scheduler": ep.scheduler_health.replace("/readyz", "/metrics"),
            "frontend": f"{ep.frontend}/metrics",
            **{node: url.replace("/readyz", "/metrics") for node, url in ep.workers.items()},
        }
        time.sleep(1.0)  # heartbeats set the load gauges: one after the last turn
        exported = scrape(urls)
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 30
    assert problems(queries, exported) == []
