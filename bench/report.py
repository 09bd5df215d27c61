"""Turns raw per-round measurements into the summary and the printed table. Pure."""

from __future__ import annotations

import math
import statistics
from typing import Any

Raw = dict[str, dict[str, list[dict[str, Any]]]]
GOALS = {
    "B1 overhead p50 ms": "<= 1.0",
    "B2 events/s vs nginx": ">= 0.75",
    "B3 wall vs direct": "<= 1.10",
    "B3 peak RSS MB": "<= 64",
    "B4 completed": "all",
    "B4 peak RSS MB": "<= 160",
    "B5 fence p99 ms": "<= 5",
}


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(raw: Raw) -> dict[str, dict[str, dict[str, float]]]:
    """scenario -> target -> metric -> value."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for scenario, by_target in raw.items():
        out[scenario] = {}
        for target, rounds in by_target.items():
            m: dict[str, float] = {}
            kind_keys = rounds[0] if rounds else {}
            if "ttft_ms" in kind_keys:
                ms = [v for r in rounds for v in r["ttft_ms"]]
                m["ttft p50 ms"], m["ttft p99 ms"] = pct(ms, 0.5), pct(ms, 0.99)
            if "events" in kind_keys:
                m["events/s"] = _median([r["events"] / r["seconds"] for r in rounds])
            if "wall_s" in kind_keys:
                m["wall s"] = _median([r["wall_s"] for r in rounds])
                m["gap p99 ms"] = _median([r["gap_p99_ms"] for r in rounds])
            if "fence_ms" in kind_keys:
                ms = [v for r in rounds for v in r["fence_ms"]]
                m["fence p50 ms"], m["fence p99 ms"] = pct(ms, 0.5), pct(ms, 0.99)
                m["fence max ms"] = max(ms) if ms else math.nan
                own = [v for r in rounds for v in r.get("proxy_fence_ms", [])]
                m["proxy fence p50 ms"] = pct(own, 0.5)
                m["proxy fence p99 ms"] = pct(own, 0.99)
                m["supersedes"] = sum(r["supersedes"] for r in rounds)
                m["sent under load"] = sum(r["sent_under_load"] for r in rounds)
                m["fenced"] = sum(r["fenced"] for r in rounds)
                m["closes seen"] = sum(r["closed_seen"] for r in rounds)
                m["load completed"] = min(r["load"]["completed"] for r in rounds)
                busy = [r["proxy_busy_supersedes"] for r in rounds if "proxy_busy_supersedes" in r]
                m["proxy CPU while superseding"] = _median(busy) if busy else math.nan
            else:
                m["completed"] = min(r["completed"] for r in rounds)
                m["requests"] = rounds[0]["requests"]
            m["peak RSS MB"] = max((r.get("peak_rss_mb") or math.nan) for r in rounds)
            for who in ("client", "upstream", "proxy"):
                m[f"cpu {who} s"] = _median([r["cpu_s"][who] for r in rounds])
            m["run s"] = _median([r["run_s"] for r in rounds])
            m["steal %"] = 100 * _median([r.get("steal", math.nan) for r in rounds])
            out[scenario][target] = m
        _relative(out[scenario])
    return out


def _relative(by_target: dict[str, dict[str, float]]) -> None:
    direct = by_target.get("direct")
    nginx = by_target.get("nginx")
    for target, m in by_target.items():
        if direct is not None and target != "direct":
            if "ttft p50 ms" in m:
                m["overhead p50 ms"] = m["ttft p50 ms"] - direct["ttft p50 ms"]
                m["overhead p99 ms"] = m["ttft p99 ms"] - direct["ttft p99 ms"]
            if "wall s" in m:
                m["wall vs direct"] = m["wall s"] / direct["wall s"]
            if "events/s" in m:
                m["events/s vs direct"] = m["events/s"] / direct["events/s"]
        if nginx is not None and "events/s" in m:
            m["events/s vs nginx"] = m["events/s"] / nginx["events/s"]


ROWS: list[tuple[str, str, str]] = [
    ("B1", "ttft p50 ms", "{:.2f}"),
    ("B1", "ttft p99 ms", "{:.2f}"),
    ("B1", "overhead p50 ms", "{:+.2f}"),
    ("B1", "overhead p99 ms", "{:+.2f}"),
    ("B2", "events/s", "{:,.0f}"),
    ("B2", "events/s vs direct", "{:.2f} x"),
    ("B2", "events/s vs nginx", "{:.2f} x"),
    ("B3", "completed", "{:.0f}"),
    ("B3", "wall s", "{:.2f}"),
    ("B3", "wall vs direct", "{:.3f} x"),
    ("B3", "gap p99 ms", "{:.1f}"),
    ("B3", "peak RSS MB", "{:.0f}"),
    ("B3", "cpu proxy s", "{:.2f}"),
    ("B4", "completed", "{:.0f}"),
    ("B4", "wall s", "{:.2f}"),
    ("B4", "wall vs direct", "{:.3f} x"),
    ("B4", "peak RSS MB", "{:.0f}"),
    ("B4", "cpu proxy s", "{:.2f}"),
    ("B5", "sent under load", "{:.0f}"),
    ("B5", "fenced", "{:.0f}"),
    ("B5", "closes seen", "{:.0f}"),
    ("B5", "fence p50 ms", "{:.2f}"),
    ("B5", "fence p99 ms", "{:.2f}"),
    ("B5", "fence max ms", "{:.2f}"),
    ("B5", "proxy fence p50 ms", "{:.2f}"),
    ("B5", "proxy fence p99 ms", "{:.2f}"),
    ("B5", "proxy CPU while superseding", "{:.2f} of a core"),
    ("B5", "load completed", "{:.0f}"),
]


def _cell(m: dict[str, float] | None, metric: str, fmt: str) -> str:
    if m is None or metric not in m or m[metric] is None or math.isnan(m[metric]):
        return ""
    return fmt.format(m[metric])


def render(results: dict[str, Any]) -> str:
    summary: dict[str, dict[str, dict[str, float]]] = results["summary"]
    targets: list[str] = results["targets"]
    mc = results["machine"]
    lines = [
        f"streamfence benchmark, {results['date']}, {mc['nproc']} CPUs ({mc['cpu']}), "
        f"Python {mc['python']}" + (" [SMOKE sizes]" if results["smoke"] else ""),
        "",
        "| scenario | metric | " + " | ".join(targets) + " | goal (streamfence) |",
        "|---|---|" + "---|" * len(targets) + "---|",
    ]
    for scenario, metric, fmt in ROWS:
        if scenario not in summary:
            continue
        by_target = summary[scenario]
        cells = [_cell(by_target.get(t), metric, fmt) for t in targets]
        if not any(cells):
            continue
        goal = GOALS.get(f"{scenario} {metric}", "")
        lines.append(f"| {scenario} | {metric} | " + " | ".join(cells) + f" | {goal} |")
    lines += [
        "",
        "CPU seconds per measurement (median of rounds), its wall time, and the share of the"
        " machine's CPU time the hypervisor gave to other guests meanwhile (steal):",
        "",
        "| scenario | target | client | upstream | proxy | wall | steal |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, by_target in summary.items():
        for target, m in by_target.items():
            proxy = _cell(m, "cpu proxy s", "{:.2f}") or "-"
            steal = _cell(m, "steal %", "{:.0f} %") or "-"
            lines.append(
                f"| {scenario} | {target} | {m['cpu client s']:.2f} | {m['cpu upstream s']:.2f}"
                f" | {proxy} | {m['run s']:.2f} | {steal} |"
            )
    lines += ["", *results["notes"]]
    return "\n".join(lines)
