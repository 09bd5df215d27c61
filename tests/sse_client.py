"""A client-side SSE reader for tests, written apart from proxy.wire.sse so that the proxy's
splitter is checked against an independent reading of the stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Event:
    event: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def is_error(self) -> bool:
        if self.event == "error":
            return True
        try:
            return isinstance(self.json, dict) and "error" in self.json
        except ValueError:
            return False

    @property
    def text(self) -> str:
        """The token text of a chat-completions chunk, "" for anything else."""
        try:
            chunk = self.json
            return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
        except (ValueError, KeyError, TypeError, AttributeError):
            return ""


async def open_stream(
    stack: AsyncExitStack,
    client: httpx.AsyncClient,
    path: str,
    body: Any,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    """A streaming POST whose response stays open until `stack` closes."""
    return await stack.enter_async_context(client.stream("POST", path, json=body, headers=headers))


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    name: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data or name:
                yield Event(name, "\n".join(data))
            name, data = None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    if data:
        yield Event(name, "\n".join(data))


async def events_of_a_cut_body(response: httpx.Response) -> list[Event]:
    """Every event of a body that ends without its terminator (an upstream cut mid-way, and
    the proxy cutting its client's body in turn): httpx raises on the end, as on any
    truncated body, after the events."""
    got: list[Event] = []
    try:
        async for event in events(response):
            got.append(event)
    except httpx.RemoteProtocolError as exc:
        assert "incomplete chunked read" in str(exc), exc
        return got
    raise AssertionError(f"the body ended cleanly after {got}")


def chat_body(prompt: str = "hi", **script: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
    }
    if script:
        body["script"] = script
    return body
