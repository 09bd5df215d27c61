"""Schedules of attempts, driven against one proxy and one scripted upstream, and the
single-writer invariant checked on what every client actually received.

A schedule is, per turn key, a list of attempts. Each attempt says how its upstream behaves
(answers, breaks after some events, or fails with 500), how its client behaves (reads to the
end, leaves before headers, leaves after some events), and when the next attempt of the same
key arrives: while this one waits for upstream headers, mid-stream after the client has read
some events, or after this one ended. Keys run concurrently; attempts of one key follow the
schedule. The scripted upstream is gated, so "when" is exact: between two events the old
attempt's upstream is parked, and what it had sent when the newer attempt was accepted is
known (`Run.sent_when_fenced`).

Checks (CONTRACT section 2), per attempt, on the client's side:
- it received events of its own attempt only, in order, no gap, no duplicate;
- nothing past what its upstream had sent when the newer attempt was accepted;
- an attempt still live when a newer one was accepted ended with the superseded frame or a
  409 (`x-should-retry: false`), never a success terminator; its upstream was closed;
- an attempt that was not fenced ended as its own upstream and client made it end;
and for the proxy: one record per request, every upstream connection closed, registry and
active set empty.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.runtime import Runtime
from tests.scripted import ScriptedUpstream, Seen
from tests.sse_client import Event, events
from tests.stress import harness

CHAT = "/v1/chat/completions"
PUSH = 1000  # permits that release a gated upstream for good
_DRIVERS = itertools.count(1)
CLOSE_LIMIT = 2.0  # seconds for the upstream to see a fenced attempt's connection closed
CUT = "upstream_error"  # the error event after which a body broken upstream is cut


@dataclass(frozen=True)
class Attempt:
    tokens: int = 3
    upstream: str = "ok"  # ok | break (connection dropped after `break_after` events) | error
    break_after: int = 1
    client: str = "stay"  # stay | leave_early (before headers) | leave_after (`leave_after` events)
    leave_after: int = 1
    next_at: str = "mid_stream"  # before_headers | mid_stream | after_end (for the next attempt)
    mid: int = 1  # events the client has read when the next attempt arrives (mid_stream)

    @property
    def stream_events(self) -> int:
        return self.tokens + 2  # tokens, the finish chunk, [DONE]


Schedule = Sequence[Sequence[Attempt]]


@dataclass
class Run:
    """What happened to one attempt, as its client saw it."""

    tag: str
    plan: Attempt
    status: int | None = None
    headers: httpx.Headers | None = None
    body: bytes = b""
    events: list[Event] = field(default_factory=list)
    seen: Seen | None = None
    leaving: bool = False
    ended: bool = False  # an error frame or [DONE] arrived: the stream's end is decided
    done: bool = False
    broken: str = ""  # the response broke on the client's side (framing, reset)
    newer_started: bool = False
    live_when_fenced: bool = False
    sent_when_fenced: int | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def over(self) -> bool:
        return self.done or self.leaving or self.ended

    def notify(self) -> None:
        self.changed.set()

    async def until(self, events: int) -> None:
        """Until the client has read `events` events or its response is over."""
        while not (self.over or len(self.events) >= events):
            self.changed.clear()
            await self.changed.wait()


class Arrivals:
    """Hands each request the upstream receives to whoever waits for its tag."""

    def __init__(self, upstream: ScriptedUpstream) -> None:
        self.upstream = upstream
        self.waiting: dict[str, asyncio.Future[Seen]] = {}
        self._done = 0
        self._task = asyncio.create_task(self._watch())

    def expect(self, tag: str) -> asyncio.Future[Seen]:
        future: asyncio.Future[Seen] = asyncio.get_running_loop().create_future()
        self.waiting[tag] = future
        return future

    async def _watch(self) -> None:
        while True:
            self.upstream.arrived.clear()
            while self._done < len(self.upstream.seen):
                seen = self.upstream.seen[self._done]
                self._done += 1
                tag = seen.json.get("tag") if seen.body.startswith(b"{") else None
                future = self.waiting.pop(tag, None) if isinstance(tag, str) else None
                if future is not None and not future.done():
                    future.set_result(seen)
            await self.upstream.arrived.wait()

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


@dataclass
class Totals:
    schedules: int = 0
    turns: int = 0
    attempts: int = 0
    superseded: int = 0
    violations: list[str] = field(default_factory=list)


def driver_client(base_url: str, timeout: float) -> httpx.AsyncClient:
    """The drivers' HTTP client: a connection per request, and so no client-side pool.

    httpcore's pool can hand one idle connection to several queued requests, which then
    queue on that connection's locks behind one another; at 1,000 turns such a chain held
    requests in the *client* for up to its 60 s timeout (found with task dumps: the proxy
    had never received their bytes). The soak test also counts descriptors: none are idle
    on the client's side."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)


class Driver:
    def __init__(self, client: httpx.AsyncClient, upstream: ScriptedUpstream, runtime: Runtime):
        self.client = client
        self.upstream = upstream
        self.runtime = runtime
        self.watch = harness.watch(runtime)
        self.totals = Totals()
        self._run_no = 0
        # Turn ids never repeat across drivers of one proxy either: a turn remembers the
        # versions it replaced (a repeat of one is refused as a stale retry).
        self._name = f"d{next(_DRIVERS)}"

    async def run(self, schedule: Schedule) -> list[list[Run]]:
        """Drive one schedule to its end and check it; violations go to `totals`."""
        self._run_no += 1
        finished_before = len(self.watch.records)
        arrivals = Arrivals(self.upstream)
        try:
            runs = await asyncio.gather(
                *(self._drive_key(arrivals, k, plans) for k, plans in enumerate(schedule))
            )
        finally:
            await arrivals.close()
        n = sum(len(plans) for plans in schedule)
        records = (await self.watch.wait(finished_before + n))[finished_before:]
        for key_runs in runs:
            for run in key_runs:
                if run.seen is not None:
                    async with asyncio.timeout(harness.WAIT_LIMIT):
                        await run.seen.over.wait()
        self.totals.schedules += 1
        self.totals.turns += len(schedule)
        self.totals.attempts += n
        self.totals.violations += check(runs, records)
        self.totals.superseded += sum(r.outcome == "superseded" for r in records)
        harness.assert_clean(self.runtime)
        return runs

    async def _drive_key(self, arrivals: Arrivals, key: int, plans: Sequence[Attempt]) -> list[Run]:
        turn_id = f"{self._name}-r{self._run_no}-k{key}"
        runs: list[Run] = []
        tasks: list[asyncio.Task[None]] = []
        prev: Run | None = None
        for i, plan in enumerate(plans):
            last = i == len(plans) - 1
            hold = plan.client == "leave_early" or (not last and plan.next_at == "before_headers")
            run = Run(tag=f"{turn_id}-a{i}", plan=plan)
            runs.append(run)
            arrived = arrivals.expect(run.tag)
            if prev is not None:
                # The previous attempt is parked (gated upstream, client waiting): what it has
                # now is what it has when this attempt is accepted.
                prev.newer_started = True
                prev.live_when_fenced = not prev.over
                assert prev.seen is not None
                prev.sent_when_fenced = prev.seen.events_sent
            tasks.append(asyncio.create_task(self._client(run, turn_id, hold)))
            try:  # a lost request fails the test, with what its client saw, instead of hanging
                async with asyncio.timeout(harness.WAIT_LIMIT):
                    run.seen = await arrived  # claimed by the proxy before it was forwarded
            except TimeoutError:
                raise AssertionError(
                    f"{run.tag} never reached the upstream: status {run.status}, "
                    f"client error {run.broken!r}, body {run.body!r}"
                ) from None
            if prev is not None and not prev.live_when_fenced:
                assert prev.seen is not None
                prev.seen.release(PUSH)  # it was over anyway: let its upstream finish
            if plan.client == "leave_early":
                tasks[-1].cancel()
                await asyncio.gather(tasks[-1], return_exceptions=True)
            elif last or plan.next_at == "after_end":
                run.seen.release(PUSH)
                await asyncio.gather(tasks[-1], return_exceptions=True)
            elif plan.next_at == "mid_stream":
                run.seen.release(plan.mid - 1)  # the first event needs no permit
                await run.until(plan.mid)
            prev = run
        for run, task in zip(runs, tasks, strict=True):
            if run.live_when_fenced and run.seen is not None:
                await asyncio.wait([task], timeout=CLOSE_LIMIT)  # a fenced client ends at once
                # The proxy closes a fenced attempt's upstream before it writes the frame, so
                # the upstream sees the close soon after the client's end. Only then is it
                # let go: released earlier, a parked upstream could finish into the closing
                # socket before noticing (uvicorn drops writes to a closed connection).
                try:
                    async with asyncio.timeout(CLOSE_LIMIT):
                        await run.seen.closed.wait()
                except TimeoutError:
                    pass  # reported by check(): "its upstream was not closed"
                run.seen.release(PUSH)
        await asyncio.gather(*tasks)
        return runs

    async def _client(self, run: Run, turn_id: str, hold: bool) -> None:
        plan = run.plan
        script: dict[str, Any] = {
            "tokens": plan.tokens,
            "prefix": f"{run.tag}:",
            "gated": True,
            "hold_headers": hold,
        }
        if plan.upstream == "break":
            script["fail_after"] = plan.break_after
        elif plan.upstream == "error":
            script["status"] = 500
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "tag": run.tag,
            "script": script,
        }
        headers = {"X-Turn-Id": turn_id, "x-request-id": run.tag}
        try:
            async with self.client.stream("POST", CHAT, json=body, headers=headers) as r:
                run.status, run.headers = r.status_code, r.headers
                run.notify()
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    run.body = await r.aread()
                    return
                async for event in events(r):
                    run.events.append(event)
                    run.ended = run.ended or event.is_error or event.data == "[DONE]"
                    run.notify()
                    if plan.client == "leave_after" and len(run.events) >= plan.leave_after:
                        run.leaving = True
                        return
        except asyncio.CancelledError:
            run.leaving = True
        except httpx.HTTPError as exc:  # the proxy must always end a response properly:
            # cleanly, or (an upstream break) cut right after its error event (CONTRACT 5)
            last = run.events[-1] if run.events else None
            cut = isinstance(exc, httpx.RemoteProtocolError) and last is not None
            if not (cut and last is not None and _kind(last, run.tag) == ("error", CUT)):
                run.broken = f"{type(exc).__name__}: {exc}"
        finally:
            run.done = True
            run.notify()


def _kind(event: Event, tag: str) -> tuple[str, Any]:
    if event.data == "[DONE]":
        return "done", None
    if event.is_error:
        return "error", event.json["error"].get("code")
    chunk = event.json
    choices = chunk.get("choices") or []
    if choices and choices[0].get("finish_reason") == "stop":
        return "finish", None
    text = event.text
    if text.startswith(f"{tag}:"):
        return "token", int(text[len(tag) + 1 :])
    return "foreign", text


def check(runs: list[list[Run]], records: Sequence[Any]) -> list[str]:
    """Every violation of the invariant in one driven schedule, as readable lines."""
    problems: list[str] = []
    by_id = {r.request_id: r for r in records}
    for key_runs in runs:
        for run in key_runs:
            problems += [f"{run.tag}: {p}" for p in _check_run(run, by_id.get(run.tag))]
            seen = run.seen
            if seen is not None and not (seen.finished or seen.broke or seen.closed.is_set()):
                problems.append(f"{run.tag}: its upstream connection was left open")
    return problems


def _check_run(run: Run, record: Any) -> list[str]:
    out: list[str] = []
    plan = run.plan
    if record is None:
        return ["no proxy record for this request"]
    if run.broken:
        out.append(f"the response broke: {run.broken}")
    kinds = [_kind(e, run.tag) for e in run.events]
    # Exactly one attempt's events, in order, without gap or duplicate.
    tokens = [v for k, v in kinds if k == "token"]
    if any(k == "foreign" for k, _ in kinds):
        out.append(f"received another attempt's events: {kinds}")
    if tokens != list(range(len(tokens))):
        out.append(f"tokens out of order, duplicated or with a gap: {tokens}")
    order = [k for k, _ in kinds]
    expected_prefix = ["token"] * plan.tokens + ["finish", "done"]
    body = order[:-1] if order and order[-1] == "error" else order
    if body != expected_prefix[: len(body)]:
        out.append(f"events not a prefix of the attempt's stream: {order}")
    if "error" in order[:-1]:
        out.append(f"an event after an error frame: {order}")
    data_events = len(body)
    superseded_frame = bool(kinds) and kinds[-1] == ("error", "stream_superseded")
    got_409 = run.status == 409
    if got_409:
        err = json.loads(run.body)["error"]
        if err["code"] != "stream_superseded" or run.headers is None:
            out.append(f"409 without the superseded error: {run.body!r}")
        elif run.headers.get("x-should-retry") != "false":
            out.append("409 without x-should-retry: false")
    fenced = superseded_frame or got_409
    if record.outcome == "superseded" and not run.newer_started:
        out.append("fenced without a newer attempt of its key (the newest is never fenced)")
    if fenced and record.outcome != "superseded":
        out.append(f"superseded frame but the proxy recorded {record.outcome}")
    # Nothing past what the upstream had sent when the newer attempt was accepted.
    if run.sent_when_fenced is not None and data_events > run.sent_when_fenced:
        out.append(f"{data_events} events but only {run.sent_when_fenced} were sent in time")
    if run.live_when_fenced and not run.leaving:
        if not fenced:
            out.append(f"live when a newer attempt was accepted, but ended {order} {run.status}")
        if "done" in order:
            out.append("a superseded attempt delivered the success terminator")
        if run.seen is not None and not (run.seen.closed.is_set() or run.seen.broke):
            out.append("superseded, but its upstream was not closed")
    elif not fenced and not run.leaving:
        out += _natural_end(run, order)
    return out


def _natural_end(run: Run, order: list[str]) -> list[str]:
    """An attempt nothing fenced ends as its own upstream made it end."""
    plan = run.plan
    if plan.upstream == "error":
        return [] if run.status == 500 else [f"expected the upstream's 500, got {run.status}"]
    if plan.upstream == "break" and plan.break_after < plan.stream_events:
        want = ["token", "finish", "done"]
        full = ["token"] * plan.tokens + want[1:]
        if order != [*full[: plan.break_after], "error"]:
            return [f"expected {plan.break_after} events and an error frame, got {order}"]
        return []
    full = ["token"] * plan.tokens + ["finish", "done"]
    return [] if order == full else [f"expected the whole stream, got {order} {run.status}"]
