"""The private hooks of the fast path (proxy/server/hooks.py), each taken away: the proxy takes
the plain path, says so once at startup, and keeps its promises on it (a fence holds, a
stream is relayed whole)."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from typing import Any

import pytest

from proxy import tasks
from proxy.config.load import from_dict
from proxy.server import hooks, listen
from proxy.server.serve import startup_lines, uvicorn_options
from tests.conftest import PROXY_LOOP, ProxyFactory
from tests.scripted import ScriptedUpstream, serve
from tests.sse_client import chat_body, events, open_stream

CHAT = "/v1/chat/completions"
CONFIG = from_dict({"upstream": [{"url": "http://127.0.0.1:1"}]})


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return PROXY_LOOP  # streamfence's own loop: its accept loop is one of the hooks


class NoHook:
    """uvicorn's HttpToolsProtocol as a release without the hook would have it."""


def without(monkeypatch: pytest.MonkeyPatch, hook: str) -> None:
    if hook == "uvicorn":
        monkeypatch.setattr(hooks, "HttpToolsProtocol", NoHook)
    elif hook == "asyncio":
        monkeypatch.setattr(tasks, "_enter_task", None)
    else:
        monkeypatch.setattr(socket.socket, "_accept", None, raising=False)


def test_with_every_hook_the_fast_path_runs_and_nothing_is_said() -> None:
    assert hooks.eager_missing() is None
    assert hooks.accept_missing() is None
    assert uvicorn_options(CONFIG)["http"] == hooks.EAGER_PROTOCOL
    assert not [line for line in startup_lines(CONFIG) if line.startswith("WARNING")]


@pytest.mark.parametrize(
    ("hook", "reason"),
    [
        ("uvicorn", "uvicorn's HttpToolsProtocol has no _start_asgi_task"),
        ("asyncio", "asyncio has no _enter_task/_leave_task"),
    ],
)
def test_without_the_eager_hooks_uvicorns_own_protocol_runs(
    monkeypatch: pytest.MonkeyPatch, hook: str, reason: str
) -> None:
    without(monkeypatch, hook)
    assert hooks.eager_missing() == reason
    assert uvicorn_options(CONFIG)["http"] == hooks.PLAIN_PROTOCOL
    (warning,) = [line for line in startup_lines(CONFIG) if line.startswith("WARNING")]
    assert warning.startswith(f"WARNING: {reason}: ")


def test_a_changed_signature_is_a_missing_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    class Changed:
        def _start_asgi_task(self, cycle: object) -> None: ...

    monkeypatch.setattr(hooks, "HttpToolsProtocol", Changed)
    assert (
        hooks.eager_missing()
        == "uvicorn's HttpToolsProtocol._start_asgi_task takes other arguments"
    )


@pytest.mark.parametrize("hook", ["uvicorn", "asyncio", "accept"])
async def test_on_the_plain_path_a_fence_still_holds(
    monkeypatch: pytest.MonkeyPatch,
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    hook: str,
) -> None:
    without(monkeypatch, hook)
    plain = hooks.PLAIN_PROTOCOL if hook != "accept" else hooks.EAGER_PROTOCOL
    assert uvicorn_options(CONFIG)["http"] == plain
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await open_stream(
                stack, client, CHAT, chat_body(gated=True, prefix="A"), {"X-Turn-Id": "t"}
            )
            a_events = events(a)
            assert (await anext(a_events)).text == "A0 "
            seen_a = (await upstream.wait_requests(1))[0]
            b = await open_stream(
                stack, client, CHAT, chat_body(prefix="B", tokens=3), {"X-Turn-Id": "t"}
            )
            rest_a = [e async for e in a_events]
            b_text = "".join([e.text async for e in events(b)])
        await seen_a.closed.wait()  # the old upstream closed, not drained
    assert [e.json["error"]["code"] for e in rest_a] == ["stream_superseded"]
    assert b_text == "B0 B1 B2 "


async def test_without_the_accept_hook_uvloop_serves_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    for missing in (False, True):
        if missing:
            without(monkeypatch, "accept")
        async with serve(app, lifespan="off") as (_, server):
            (server_of_socket,) = server.servers
            assert isinstance(server_of_socket, listen.Listener) is not missing
