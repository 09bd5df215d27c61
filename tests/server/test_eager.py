"""proxy/server/eager.py: uvicorn's protocol with each request's first step taken in the read
that completed it. Driven by hand with a transport that records writes, so "in the same
callback" is checked exactly: nothing is awaited between the bytes and the check."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from tests.conftest import PROXY_LOOP


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8787), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def protocol(app: Any) -> tuple[Any, Transport]:
    config = uvicorn.Config(
        app, http="proxy.server.eager:Protocol", lifespan="off", log_config=None, access_log=False
    )
    config.load()
    proto = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    proto.connection_made(transport)
    return proto, transport


async def feed(proto: Any, data: bytes, seen: list[Any]) -> list[Any]:
    """`data` to the protocol from a loop callback, outside any task, as uvloop reads: what
    `seen` holds when data_received has returned, still in that callback."""
    loop = asyncio.get_running_loop()
    fed: asyncio.Future[list[Any]] = loop.create_future()

    def read() -> None:
        proto.data_received(data)
        fed.set_result(list(seen))

    loop.call_soon(read)
    return await fed


def request(body: bytes, path: str = "/") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def test_a_request_takes_its_first_step_in_the_read_that_completed_it() -> None:
    seen: list[Any] = []
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])  # the body is in: no wait
        seen.append(asyncio.current_task())
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    proto, transport = protocol(app)
    raw = request(b'{"a": 1}')
    assert await feed(proto, raw[:10], seen) == []  # an incomplete request starts nothing
    in_the_read = await feed(proto, raw[10:], seen)
    (task,) = proto.tasks
    # Its task runs at the loop's next iteration; the first step already has, as that task.
    assert in_the_read == [b'{"a": 1}', task]
    release.set()
    await asyncio.wait_for(task, 5)
    assert transport.written.startswith(b"HTTP/1.1 200 OK") and b"\r\nok\r\n" in transport.written


async def test_a_pipelined_request_starts_when_the_one_before_it_has_answered() -> None:
    order: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        order.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})

    proto, transport = protocol(app)
    # The second waits for the first's answer, as in uvicorn.
    assert await feed(proto, request(b"1", "/first") + request(b"2", "/second"), order) == [
        "/first"
    ]
    while proto.tasks:  # the first's task, then the second's, started by its answer
        await asyncio.wait(set(proto.tasks), timeout=5)
        await asyncio.sleep(0)  # a yield: their done callbacks (uvicorn's discard) run
    assert order == ["/first", "/second"]
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2
    assert transport.written.index(b"/first") < transport.written.index(b"/second")


# On the proxy's own loop, where uvloop calls data_received, as in production.
pytestmark = pytest.mark.parametrize("anyio_backend", [PROXY_LOOP], ids=["uvloop"])
