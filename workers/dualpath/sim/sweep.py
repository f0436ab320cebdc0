"""`dualpath plan --sweep`: where dual-path pays, over node budget x storage NIC x decode KV.

    dualpath plan --trace out/cc.jsonl --sweep --plot out/sweep.png
    dualpath plan --trace out/cc.jsonl --sweep --sweep-nodes 12 --sweep-snic-gbps 200,400,800 \
        --sweep-kv-gb 400,800 --json

Every cell is a whole plan (the planner `dualpath.sim.plan` passes in: each policy's best
split, capacity by bisection, several seeds): the table and the heatmap give dualpath /
prefill-read at each one's best split with its 95% interval, and what binds each policy there.
Below `plan.py` (which calls it), over `points.py` (what both say of a plan's points).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from dualpath.config import ModelSpec
from dualpath.sim.points import BASELINE, Point, compare, hardware, ties


def sweep(
    args: argparse.Namespace,
    meta: dict[str, Any],
    model: ModelSpec,
    policies: list[str],
    grid: tuple[list[int], list[float], list[float]],
    planner: Any,
) -> dict[str, Any]:
    """Plan every (node budget, SNIC Gbit/s, decode KV GB) of `grid`: per cell each policy's
    best split and goodput, and the ratio with its interval. A cell's search starts from the
    best P of the previous cell with the same budget (neighbouring hardware, a near split)."""
    nodes_l, snics, kvs = grid
    cells = []
    start: dict[tuple[str, int], int] = {}
    runs = 0
    left = len(nodes_l) * len(kvs) * len(snics)
    for n in nodes_l:
        for kv in kvs:
            for snic in snics:
                left -= 1
                pl = planner(hardware(args, snic, int(kv * 1e9)))
                # The ETA counts the searches of the cells still to come as well.
                pl.searches_after = len(policies) * (left + 1) - 1
                if pl.progress is not None:
                    pl.progress(
                        f"[sweep] cell {len(cells) + 1} of {len(cells) + left + 1}: {n} nodes, "
                        f"SNIC {snic:g} Gbit/s, decode KV {kv:g} GB"
                    )
                best: dict[str, Point] = {}
                tied: dict[str, list[str]] = {}
                for pol in policies:
                    best[pol], tried = pl.best_split(pol, n, start.get((pol, n), 0))
                    start[(pol, n)] = best[pol].prefill
                    tied[pol] = [f"{t.prefill}:{t.decode}" for t in ties(best[pol], tried)]
                runs += pl.runs
                cmp = compare(best)
                cells.append(
                    {
                        "nodes": n,
                        "snic_gbps": snic,
                        "kv_gb_per_decode_node": kv,
                        "best": {
                            pol: {
                                "split": f"{pt.prefill}:{pt.decode}",
                                "tokens_per_s": round(pt.tokens_per_s, 1),
                                "tokens_per_s_interval": [round(x, 1) for x in pt.spread],
                                "meets_slo": pt.meets_slo,
                                "binding": pt.binding,
                                "overload_binding": pt.overload_binding,
                                "path_d_fraction": round(pt.path_d_fraction, 3),
                                "ties": tied[pol],
                            }
                            for pol, pt in best.items()
                        },
                        "ratio": cmp,
                        "runs": pl.runs,
                    }
                )
    return {
        "trace": meta.get("name") or args.trace,
        "model": model.name,
        "slo": {"ttft_p90_s": args.ttft_slo, "tpot_p90_s": args.tpot_slo},
        "seeds": list(range(args.seed, args.seed + args.seeds)),
        "grid": {"nodes": nodes_l, "snic_gbps": snics, "kv_gb_per_decode_node": kvs},
        "cells": cells,
        "runs": runs,
    }


def sweep_table(result: dict[str, Any]) -> str:
    lines = [
        f"sweep for {result['trace']} ({result['model']}, SLO TTFT p90 <= "
        f"{result['slo']['ttft_p90_s']} s, TPOT p90 <= {result['slo']['tpot_p90_s']} s, "
        f"{len(result['seeds'])} seeds): dualpath / {BASELINE} at each one's best split",
        f"{'nodes':>5} {'SNIC Gb/s':>9} {'KV GB/D':>7} {'ratio [95%]':>20}  "
        f"{'dualpath: P:D tok/s binding':<40} {BASELINE + ': P:D tok/s binding':<40}",
    ]
    for c in result["cells"]:
        r = c["ratio"]
        rat = f"{r['ratio']:.2f} [{r['interval'][0]:.2f}-{r['interval'][1]:.2f}]" if r else "-"
        pays = " >1.2" if r and r["above_1_2"] else "     "

        dp, base = (_side(c["best"].get(pol)) for pol in ("dualpath", BASELINE))
        lines.append(
            f"{c['nodes']:>5} {c['snic_gbps']:>9g} {c['kv_gb_per_decode_node']:>7g} "
            f"{rat:>20}{pays} {dp:<40} {base:<40}"
        )
    lines.append(
        ">1.2: the whole interval is above 1.2x. binding: the most utilised resource at the "
        "best split's capacity"
    )
    lines.append(
        f"({result['runs']} simulations, {result['wall_s']} s, load average "
        f"{result.get('load_average')})"
    )
    return "\n".join(lines)


def _side(b: dict[str, Any] | None) -> str:
    return f"{b['split']} {b['tokens_per_s']:,.0f} {b['binding']}" if b else "-"


def heatmap(result: dict[str, Any], path: str) -> None:
    """One panel per node budget: SNIC Gbit/s across, decode KV GB up, colour the ratio,
    each cell labelled with the ratio, its interval and what binds each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result["grid"]
    budgets, snics, kvs = g["nodes"], g["snic_gbps"], g["kv_gb_per_decode_node"]
    fig, axes = plt.subplots(
        1, len(budgets), figsize=(5.2 * len(budgets) + 1, 3.2 + 0.7 * len(kvs)), squeeze=False
    )
    short = {
        "prefill_snic": "P-SNIC",
        "decode_snic": "D-SNIC",
        "prefill_gpu": "P-GPU",
        "decode_kv_memory": "D-KV",
        "prefill_cnic": "P-CNIC",
        "decode_cnic": "D-CNIC",
        "": "-",
    }
    im = None
    for ax, n in zip(axes[0], budgets, strict=True):
        grid = [[math.nan] * len(snics) for _ in kvs]
        for c in result["cells"]:
            if c["nodes"] != n:
                continue
            i, j = kvs.index(c["kv_gb_per_decode_node"]), snics.index(c["snic_gbps"])
            r = c["ratio"]
            grid[i][j] = r["ratio"] if r else math.nan
            dp, base = c["best"].get("dualpath", {}), c["best"].get(BASELINE, {})
            label = (
                (
                    f"{r['ratio']:.2f}x\n[{r['interval'][0]:.2f}-{r['interval'][1]:.2f}]\n"
                    if r
                    else "-\n"
                )
                + f"{short.get(dp.get('binding', ''), '?')} / {short.get(base.get('binding', ''), '?')}"
            )
            ax.text(
                j,
                i,
                label,
                ha="center",
                va="center",
                fontsize=7.5,
                fontweight="bold" if r and r["above_1_2"] else "normal",
            )
        im = ax.imshow(grid, origin="lower", cmap="RdYlGn", vmin=0.8, vmax=2.0, aspect="auto")
        ax.set_xticks(range(len(snics)), [f"{x:g}" for x in snics])
        ax.set_yticks(range(len(kvs)), [f"{x:g}" for x in kvs])
        ax.set_xlabel("SNIC Gbit/s per node")
        if ax is axes[0][0]:
            ax.set_ylabel("decode KV GB per decode node")
        ax.set_title(f"{n} nodes: dualpath / {BASELINE}")
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), label="ratio at each one's best split")
    fig.suptitle(
        f"{result['trace']}: where dual-path pays (bold: interval above 1.2x; "
        "binding dualpath / baseline)",
        fontsize=9,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
