"""deploy/grafana/streamfence.json: every PromQL query names only metrics (and labels) that the
proxy really exports, read from the proxy's own Metrics after exercising every series; the
dashboard shows what the issue asks of it; its panels do not overlap."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.ops.ledger import Ledger
from proxy.ops.metrics import Metrics
from proxy.ops.record import Record
from proxy.wire.usage import Usage

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "streamfence.json"
# Added by Prometheus to every series it scrapes, not by the exporter.
TARGET_LABELS = {"job", "instance"}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
IDENT = re.compile(r"([a-zA-Z_:][\w:]*)(\s*\()?")


def exported() -> dict[str, set[str]]:
    """Every sample name the proxy's metrics render, with its label names, after each
    labelled series has been touched once (an untouched labelled counter renders nothing)."""
    metrics = Metrics()
    for outcome in ("completed", "superseded", "client_gone", "upstream_error", "rejected"):
        record = Record(method="POST", path="/v1/chat/completions", upstream="u")
        record.dialect, record.outcome, record.events, record.dropped = "openai-chat", outcome, 2, 1
        record.fence_latency = 0.001
        record.forwarded_at = record.upstream_headers_at = record.first_byte_at = record.started
        metrics.observe(record, "connect" if outcome == "upstream_error" else None)
    for how in ("followed", "resumed", "replayed"):
        metrics.follows.labels("u", how).inc()
    metrics.saved.labels("u").inc()
    metrics.generations.labels("u").inc()
    metrics.events_saved.labels("u").inc()
    metrics.follow_refused.labels("u", "buffer_over_cap").inc()
    metrics.registry_unavailable.inc()
    metrics.logs_abandoned.labels("lost").inc()
    ledger = Ledger(metrics, 10)  # its counters: spent, cut and events cut; spared
    ledger.answered("u", "m", Usage(input=1, output=1), True, 3)
    ledger.served("u", "m", Usage(input=1, output=1))
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                yield f"panel {panel['title']!r}", target["expr"]

    yield from walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']!r}", var["query"]["query"]


def parse(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """A small PromQL reader: the metric names, the labels each selector matches on, and
    the labels grouped by (`by (...)`, `without (...)`, label_values' second argument)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings: "$upstream", ".*"
    selectors: dict[str, set[str]] = {}
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", e):
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))
        selectors.setdefault(m.group(1), set()).update(labels)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range durations: [5m], [$__rate_interval]
    grouped: set[str] = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", e):
        grouped.update(x.strip() for x in m.group(1).split(",") if x.strip())
    # Vector matching names labels too, of both sides: left out of the check.
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    lv = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)\s*", e)
    if lv:
        return {lv.group(1)}, {}, {lv.group(2)}
    names = {
        m.group(1)
        for m in IDENT.finditer(e)
        if not m.group(2) and m.group(1) not in KEYWORDS and not e[m.start() - 1 : m.start()] == "$"
    }
    return names, selectors, grouped


def test_the_reader_sees_through_a_query() -> None:
    names, selectors, grouped = parse(
        'histogram_quantile(0.99, sum by (le, upstream) (rate(foo_bucket{upstream=~"$u"}[5m])))'
        " / on (x) bar_total"
    )
    assert names == {"foo_bucket", "bar_total"}
    assert selectors == {"foo_bucket": {"upstream"}}
    assert grouped == {"le", "upstream"}


def test_every_query_names_a_metric_and_labels_the_proxy_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    have = exported()
    seen: set[str] = set()
    checked = 0
    for where, expr in queries(dashboard):
        names, selectors, grouped = parse(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            assert name in have, f"{where}: {name} is not exported by the proxy ({expr!r})"
        for name, labels in selectors.items():
            assert labels <= have[name] | TARGET_LABELS, f"{where}: {name} has no {labels}"
        available = set().union(*(have[n] for n in names)) | TARGET_LABELS
        assert grouped <= available, f"{where}: grouped by {grouped - available}"
        seen |= names
        checked += 1
    assert checked >= 20
    # What an operator of a gateway looks for first (the list).
    for needed in (
        "streamfence_streams_in_flight",
        "streamfence_requests_total",
        "streamfence_supersedes_total",
        "streamfence_follows_total",
        "streamfence_fence_latency_seconds_bucket",
        "streamfence_added_ttfb_seconds_bucket",
        "streamfence_upstream_errors_total",
        "streamfence_build_info",
        "streamfence_tokens_total",
        "streamfence_tokens_spared_total",
        "streamfence_tokens_cut_total",
        "streamfence_events_cut_total",
    ):
        assert needed in seen, needed


def test_a_query_for_a_metric_that_does_not_exist_would_be_caught() -> None:
    have = exported()
    names, _, _ = parse("sum(rate(streamfence_request_total[5m]))")  # a typo: no "s"
    assert names == {"streamfence_request_total"} and not names <= set(have)


def test_panels_fit_the_grid_and_use_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "streamfence"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{panel['title']!r} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "upstream"} <= variables
