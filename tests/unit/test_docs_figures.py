"""One figure, one value: what the README quotes is what docs/benchmarks.md measured.

docs/benchmarks.md keeps every run with its command; the README's Benchmarks table quotes the
headline of each. A headline (a bold number) that docs/benchmarks.md does not carry is a second
value for one figure, or a figure with no run behind it. The factors the code uses and the
documents state (a turn's hit read against its prefill) are checked against the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dualpath import demo
from dualpath.local import bench

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BOLD_NUMBER = re.compile(r"\*\*([^*]*?\d[^*]*?)\*\*")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def section(text: str, title: str) -> str:
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    rows = [ln for ln in text.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def command_of(cell: str) -> str | None:
    found = re.search(r"`([^`]+)`", cell)
    return found.group(1) if found else None


def measured_rows() -> dict[str, str]:
    """docs/benchmarks.md's table rows by command (a `same` row belongs to the command above)."""
    rows: dict[str, str] = {}
    current = None
    for line in (DOCS / "benchmarks.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        first = line.strip("|").split("|")[0].strip()
        if not first.startswith("same"):
            current = command_of(first)
        if current:
            rows[current] = rows.get(current, "") + line + "\n"
    return rows


def readme_headlines() -> list[tuple[str, str]]:
    """(command, number) for every bold number of the README's Benchmarks table."""
    out = []
    for row in table_rows(section((ROOT / "README.md").read_text(), "Benchmarks")):
        command, figure = row[0], row[-1]
        for bold in BOLD_NUMBER.findall(figure):
            out += [(command, n) for n in numbers(bold)]
    return out


def test_the_readme_quotes_headlines():
    assert len(readme_headlines()) >= 10


@pytest.mark.parametrize(("command", "value"), readme_headlines())
def test_every_readme_headline_is_a_measured_figure_of_docs_benchmarks(command, value):
    # the rows of the same command where docs/benchmarks.md has them, else the whole document
    rows = measured_rows().get(command_of(command) or "")
    measured = set(numbers(rows if rows else (DOCS / "benchmarks.md").read_text()))
    assert value in measured, (
        f"README's {command} gives {value}, which docs/benchmarks.md does not carry: "
        "one figure, two values (or no run behind it)"
    )


def test_the_documents_state_the_read_to_compute_factors_the_code_uses():
    bench_x, demo_x = f"{bench.READ_TO_COMPUTE:g}x", f"{demo.DEMO_READ_TO_COMPUTE:g}x"
    claims = {
        "README.md": (ROOT / "README.md").read_text(),
        **{p.name: p.read_text() for p in DOCS.glob("*.md")},
    }
    said = {
        name: re.findall(r"(\d+(?:\.\d+)?x) its (?:measured )?prefill", text)
        for name, text in claims.items()
    }
    allowed = {bench_x, demo_x, f"{bench.VLLM_READ_TO_COMPUTE:g}x"}
    wrong = {name: xs for name, xs in said.items() if set(xs) - allowed}
    assert wrong == {}, f"the code reads at {bench_x} (bench local) and {demo_x} (demo)"
    # and the demo's factor is said where the demo is described
    assert any(demo_x in text and "demo" in text for text in claims.values())
