"""What the proxy spent upstream and what its fence and its follows spared (issue 30), per
upstream and model: the token counters in the metrics, the totals on the status page, the
demo's last line.

- **Spent**: every generation that asked upstream, once its answer is over, with the usage
  its provider reported (`proxy.turn.meter`). A fenced generation was billed for what it had
  produced too: its known tokens are spent, and counted again as **cut** (Anthropic reports
  the input at the start, so a fenced Anthropic answer still has it; a fenced OpenAI stream
  reports nothing), with the events it had relayed.
- **Spared**: every client served without a request of its own (followed, resumed, replayed)
  that got the whole answer: its generation's usage once more, as a request and as tokens.

Models become metric labels: the first `max_models` distinct names of each upstream, then
`other`, so that odd or hostile request bodies cannot blow up the metrics' cardinality.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import Counter

from proxy.ops.metrics import Metrics
from proxy.wire.usage import Usage

OTHER: Final = "other"  # the label of models past the bound
UNKNOWN: Final = "unknown"  # the label when neither request nor answer named a model


@dataclass(slots=True)
class Tally:
    """Requests and tokens of one upstream and model, since the process started."""

    requests: int = 0
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, usage: Usage | None, requests: int = 1) -> None:
        self.requests += requests
        if usage is not None:
            for kind, n in usage.counts():
                self.tokens[kind.value] = self.tokens.get(kind.value, 0) + n


class ModelLabels:
    """The label of a model: itself for the first `limit` distinct ones of an upstream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: dict[str, set[str]] = defaultdict(set)

    def __call__(self, upstream: str, model: str | None) -> str:
        if not model:
            return UNKNOWN
        seen = self._seen[upstream]
        if model in seen:
            return model
        if len(seen) >= self.limit:
            return OTHER
        seen.add(model)
        return model


class Ledger:
    def __init__(self, metrics: Metrics, max_models: int) -> None:
        self.label = ModelLabels(max_models)
        r = metrics.registry
        self._tokens = _counter(r, "streamfence_tokens", "Tokens the upstream reported")
        self._spared = _counter(
            r, "streamfence_tokens_spared", "Tokens of answers served to followers and replays"
        )
        self._cut = _counter(
            r, "streamfence_tokens_cut", "Tokens of generations a newer one fenced"
        )
        self._events_cut = Counter(
            "streamfence_events_cut",
            "Events fenced generations had relayed before the fence",
            ["upstream"],
            registry=r,
        )
        # Since start, by (upstream, model label): what the status page and the demo show.
        self.spent: dict[tuple[str, str], Tally] = defaultdict(Tally)
        self.spared: dict[tuple[str, str], Tally] = defaultdict(Tally)
        self.cut: dict[tuple[str, str], Tally] = defaultdict(Tally)

    def answered(
        self, upstream: str, model: str | None, usage: Usage | None, fenced: bool, events: int
    ) -> None:
        """An answer asked upstream is over (fenced or not). `model`: the one its request
        named; the answer's own name, more precise ("gpt-4o-2024-08-06"), wins."""
        label = self._label(upstream, model, usage)
        self.spent[upstream, label].add(usage)
        _count(self._tokens, upstream, label, usage)
        if fenced:
            self.cut[upstream, label].add(usage)
            _count(self._cut, upstream, label, usage)
            if events:
                self._events_cut.labels(upstream).inc(events)

    def served(self, upstream: str, model: str | None, usage: Usage | None) -> None:
        """A client got a whole answer without a request of its own."""
        label = self._label(upstream, model, usage)
        self.spared[upstream, label].add(usage)
        _count(self._spared, upstream, label, usage)

    def _label(self, upstream: str, model: str | None, usage: Usage | None) -> str:
        return self.label(upstream, (usage.model if usage is not None else None) or model)

    def summary(self) -> list[dict[str, Any]]:
        """Per upstream and model, since start: requests and tokens spent, spared and cut."""
        keys = sorted(set(self.spent) | set(self.spared))
        return [
            {
                "upstream": upstream,
                "model": model,
                "requests": self.spent[upstream, model].requests,
                "tokens": self.spent[upstream, model].tokens,
                "requests_spared": self.spared[upstream, model].requests,
                "tokens_spared": self.spared[upstream, model].tokens,
                "fenced": self.cut[upstream, model].requests,
                "tokens_cut": self.cut[upstream, model].tokens,
            }
            for upstream, model in keys
        ]


def _counter(registry: Any, name: str, doc: str) -> Counter:
    return Counter(name, doc, ["upstream", "model", "kind"], registry=registry)


def _count(counter: Counter, upstream: str, model: str, usage: Usage | None) -> None:
    if usage is not None:
        for kind, n in usage.counts():
            counter.labels(upstream, model, kind.value).inc(n)
