"""Named simulation setups shaped like the paper's (arXiv 2602.21548) experiments.

A preset fixes the model, the trace shape, the P/D node counts, the mode and the x axis
(agents for offline, agent arrival rate for online, cluster size for the scale sweep). The
paper's reported dual-path / baseline ratios ride along so the CLI prints them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(slots=True, frozen=True)
class Preset:
    name: str
    help: str
    mode: str  # "offline" | "online" | "scale"
    model: str
    trace: str  # dualpath.trace preset: 32k / 48k / 64k
    prefill_nodes: int
    decode_nodes: int
    # offline: agents per point; online: agent arrivals per second; scale: prefill node counts
    xs: tuple[float, ...]
    mean_think_s: float = 1.0
    horizon_s: float = float("inf")  # offline: run to completion unless capped
    warmup_s: float = 0.0
    ttft_sla_s: float = 4.0
    agent_group: int = 1
    # scale: agents per prefill node (decode nodes = 2 x prefill nodes)
    agents_per_prefill: int = 0
    # offline: at most this many agents per prefill node run at once (0 = all start at t=0)
    active_per_prefill: int = 0
    paper: dict[str, float] = field(default_factory=dict)


PAPER_OFFLINE = {"offline_throughput_ratio": 1.87}
PAPER_ONLINE = {"online_throughput_ratio": 1.96, "max_arrival_rate_ratio": 2.25}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "offline",
            "DeepSeek-V3.2-like, 32K trace, 1P2D, N agents to completion",
            "offline",
            "deepseek-v3.2",
            "32k",
            1,
            2,
            (64, 128, 256, 512, 1024),
            paper=PAPER_OFFLINE,
        ),
        Preset(
            "offline-64k",
            "DeepSeek-V3.2-like, 64K trace, 2P4D, N agents to completion",
            "offline",
            "deepseek-v3.2",
            "64k",
            2,
            4,
            (128, 256, 512, 1024),
            paper=PAPER_OFFLINE,
        ),
        Preset(
            "offline-27b",
            "27B DeepSeek-style MLA, 48K trace, 1P1D",
            "offline",
            "dsmla-27b",
            "48k",
            1,
            1,
            (64, 128, 256, 512),
            paper=PAPER_OFFLINE,
        ),
        Preset(
            "offline-qwen",
            "Qwen2.5-32B (GQA, 256 KB/token), 32K trace, 1P2D",
            "offline",
            "qwen2.5-32b",
            "32k",
            1,
            2,
            (32, 64, 128, 256),
            paper=PAPER_OFFLINE,
        ),
        Preset(
            "online",
            "DeepSeek-V3.2-like, 32K trace, 2P4D, Poisson agent arrivals",
            "online",
            "deepseek-v3.2",
            "32k",
            2,
            4,
            (1.0, 2.0, 2.5, 3.0, 4.0, 4.5, 5.0, 6.0, 8.0),
            horizon_s=600.0,
            warmup_s=150.0,
            paper=PAPER_ONLINE,
        ),
        Preset(
            "scale",
            "throughput from 2P+4D to 48P+96D, 512 agents at a time per P node",
            "scale",
            "deepseek-v3.2",
            "32k",
            0,
            0,
            (2, 4, 8, 16, 32, 48),
            horizon_s=300.0,
            warmup_s=100.0,
            agents_per_prefill=1536,
            active_per_prefill=512,
            agent_group=8,
        ),
        # 512 agents per prefill node at a time (the offline preset's saturated point), 7680
        # per node in all: the job outlasts the one-hour horizon.
        Preset(
            "bench",
            "48P+96D, one simulated hour of the offline workload (speed bench)",
            "offline",
            "deepseek-v3.2",
            "32k",
            48,
            96,
            (48 * 7680,),
            horizon_s=3600.0,
            agent_group=32,
            active_per_prefill=512,
            paper=PAPER_OFFLINE,
        ),
        Preset(
            "tiny",
            "2P+2D, few agents; for tests and smoke runs",
            "offline",
            "deepseek-v3.2",
            "32k",
            1,
            2,
            (8, 16),
            paper=PAPER_OFFLINE,
        ),
    ]
}
# The same run under a name that says what it is.
PRESETS["offline-48p96d"] = replace(PRESETS["bench"], name="offline-48p96d", help="alias of bench")
