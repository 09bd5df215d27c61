"""The openai Python SDK's WebSocket mode (`client.responses.connect()`) through the proxy,
against the scripted Responses WebSocket upstream: a plain turn, a previous_response_id
chain, a fenced response, and what a chain does after the fence replaced its upstream socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAIError

from tests.conftest import Proxy, ProxyFactory
from tests.ws_upstream import WsUpstream, ws_upstream

SCRIPT = {"turns.ignore_fields": "stream,stream_options,timeout,metadata"}
# Every identical repeat supersedes: these tests are about the fence, not about on_retry.
SUPERSEDE = {**SCRIPT, "upstream.on_retry": "supersede"}

if not hasattr(AsyncOpenAI(api_key="x").responses, "connect"):  # pragma: no cover
    pytest.skip("this openai SDK has no Responses WebSocket mode", allow_module_level=True)


@pytest.fixture
async def wsup() -> AsyncIterator[WsUpstream]:
    async with ws_upstream() as upstream:
        yield upstream


def sdk(proxy: Proxy) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)


def create(text: str, previous: str | None = None, **script: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "response.create", "model": "m", "input": text}
    if previous is not None:
        event["previous_response_id"] = previous
    if script:
        event["metadata"] = {"script": json.dumps(script)}
    return event


async def turn(conn: Any) -> tuple[str, str]:
    """The response id and text of one response, read through the SDK's typed events."""
    text = ""
    async for event in conn:
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            return event.response.id, text
        elif event.type == "error":
            raise OpenAIError(f"{event.error.code}: {event.error.message}")
    raise AssertionError("the socket closed before the response ended")


async def test_plain_turn(wsup: WsUpstream, make_proxy: ProxyFactory) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        async with sdk(proxy).responses.connect() as conn:
            await conn.send(create("hello", tokens=["Hi", " there"]))  # type: ignore[arg-type]
            rid, text = await turn(conn)
        assert text == "Hi there" and rid.startswith("resp_")
        up = (await wsup.wait_conns(1))[0]
        assert up.path == "/v1/responses"
        assert up.headers["Authorization"] == "Bearer sk-test"


async def test_previous_response_id_chain_on_one_socket(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        async with sdk(proxy).responses.connect() as conn:
            previous = None
            for i in range(4):
                event = {**create(f"step {i}", previous, tokens=1, prefix=f"s{i}-"), "store": False}
                await conn.send(event)  # type: ignore[arg-type]
                previous, text = await turn(conn)
                assert text == f"s{i}-0 "
        assert len(wsup.conns) == 1 and len(wsup.gens) == 4
        assert [g.request.get("previous_response_id") for g in wsup.gens][1:] == [
            g.id for g in wsup.gens[:3]
        ]


async def test_fenced_response_raises_in_the_sdk_and_the_winner_completes(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SUPERSEDE) as proxy:
        client = sdk(proxy)
        async with client.responses.connect() as first:
            await first.send(create("same", gated=True, tokens=3))  # type: ignore[arg-type]
            gen = (await wsup.wait_gens(1))[0]
            assert (await first.recv()).type == "response.created"
            async with client.responses.connect() as second:
                await second.send(create("same", tokens=2, prefix="w"))  # type: ignore[arg-type]
                with pytest.raises(OpenAIError) as raised:
                    await first.dispatch_events()
                assert "stream_superseded" in str(raised.value)
                assert "superseded by attempt 2" in str(raised.value)
                _, text = await turn(second)
                assert text == "w0 w1 "
            await asyncio.wait_for(gen.over.wait(), 1)
            assert gen.cut and not gen.finished


@pytest.mark.parametrize("store", [True, False])
async def test_chain_after_the_fence_reopened_the_upstream_socket(
    wsup: WsUpstream, make_proxy: ProxyFactory, store: bool
) -> None:
    """The fence stops a generation by closing its upstream socket (the protocol has no
    cancel message). A stored response still chains on the new socket; with store=false the
    connection-local cache went with the old socket, and the upstream answers
    previous_response_not_found: the client starts the chain again with full input."""
    async with make_proxy(wsup.url, **SUPERSEDE) as proxy:
        client = sdk(proxy)
        async with client.responses.connect() as conn:
            await conn.send({**create("one", tokens=1), "store": store})  # type: ignore[arg-type]
            first_id, _ = await turn(conn)
            await conn.send(  # type: ignore[arg-type]
                {**create("two", first_id, gated=True), "store": store}
            )
            await wsup.wait_gens(2)
            assert (await conn.recv()).type == "response.created"
            async with client.responses.connect() as other:  # the retry of "two" elsewhere
                await other.send(  # type: ignore[arg-type]
                    {**create("two", first_id, tokens=1), "store": store}
                )
                with pytest.raises(OpenAIError, match="stream_superseded"):
                    await turn(conn)
                if store:
                    await turn(other)
                else:
                    with pytest.raises(OpenAIError, match="previous_response_not_found"):
                        await turn(other)
            # The fenced socket goes on, on a new upstream socket.
            await conn.send(  # type: ignore[arg-type]
                {**create("three", first_id, tokens=1, prefix="t"), "store": store}
            )
            if store:
                assert (await turn(conn))[1] == "t0 "
            else:
                with pytest.raises(OpenAIError, match="previous_response_not_found"):
                    await turn(conn)
                await conn.send(  # type: ignore[arg-type]
                    {**create("one two three", tokens=1, prefix="f"), "store": store}
                )
                assert (await turn(conn))[1] == "f0 "
