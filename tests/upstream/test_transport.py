"""proxy.upstream.transport against real servers on 127.0.0.1: raw asyncio servers whose every byte
the test scripts, so framing, keep-alive, closes and resets are exactly what is asked for.

Synchronisation is by events the server sets (request seen, EOF seen), never by sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trustme

from proxy.config import egress
from proxy.config.load import load
from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from proxy.upstream import client as upstream
from proxy.upstream import connection, pacing
from proxy.upstream.client import create_client, translate_errors
from proxy.upstream.transport import Body, Transport
from tests.config.test_egress import forward_proxy
from tests.conftest import PROXY_LOOP

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
GUARD = 5.0  # seconds: a hang fails the test instead of the run


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.got_request = asyncio.Event()
        self.saw_eof = asyncio.Event()
        self.url = ""

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request's head and body (content-length or chunked); None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        body = b""
        lower = head.lower()
        if b"content-length:" in lower:
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        elif b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                body += (await reader.readexactly(size + 2))[:-2]
                if size == 0:
                    break
        self.requests.append(head + body)
        self.got_request.set()
        return head + body

    async def wait_eof(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.saw_eof.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()


@asynccontextmanager
async def serve(
    handler: Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[Server]:
    server = Server(lambda r, w: handler(server, r, w))
    srv = await asyncio.start_server(server._handle, "127.0.0.1", 0, ssl=tls)
    port = srv.sockets[0].getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield server
    finally:
        srv.close()


def client(transport: Transport, **kw: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, timeout=GUARD, **kw)  # type: ignore[arg-type]


FIRST_CHUNK = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"


def answers_then_holds(
    head: bytes,
) -> Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A handler that reads the request, writes `head` (a response's start), then holds
    the connection open until the client closes it."""

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(head)
        await w.drain()
        await server.wait_eof(r)

    return handler


def content_length_response(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def keep_alive_echo(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while (request := await server.read_request(r)) is not None:
        body = request.split(b"\r\n\r\n", 1)[1]
        w.write(content_length_response(b"echo:" + body))
        await w.drain()


async def test_keep_alive_connection_is_reused() -> None:
    async with serve(keep_alive_echo) as server, client(Transport()) as c:
        for i in range(3):
            r = await c.post(server.url + "/x?q=1", content=b"hello %d" % i)
            assert r.status_code == 200
            assert r.content == b"echo:hello %d" % i
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /x?q=1 HTTP/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:" in server.requests[0].lower()


async def test_a_response_that_says_connection_close_never_goes_back_to_the_pool() -> None:
    # The server says it closes (Go and Node capitalise the header) but has not yet: the
    # next request must not be sent on that socket, which may be closing under it.
    async def says_close(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            w.write(content_length_response(b"ok", b"Connection: Close\r\n"))
            await w.drain()

    transport = Transport()
    async with serve(says_close) as server, client(transport) as c:
        for _ in range(2):
            assert (await c.get(server.url)).content == b"ok"
        assert server.connections == 2
        assert transport.idle() == 0 and transport.in_use() == 0


@pytest.mark.parametrize(
    ("url", "asked"),
    [
        ("http://127.0.0.1/x", ("GET", "http://127.0.0.1/x")),
        ("https://127.0.0.1/x", ("CONNECT", "127.0.0.1:443")),
    ],
)
async def test_a_url_without_a_port_goes_to_its_schemes_default_port(
    url: str, asked: tuple[str, str]
) -> None:
    # Seen at an egress proxy, which is chosen per origin (scheme, host, port): the port the
    # pool keys a connection by is the one the origin's egress was planned for.
    async with forward_proxy(refuse_connect=True) as fp:
        overrides = {"upstream.url": url.removesuffix("/x"), "upstream.egress_proxy": fp.url}
        transport = Transport(egress=egress.plan(load(env={}, overrides=overrides), {}))
        async with client(transport) as c:
            with pytest.raises(httpx.HTTPError):  # nothing listens there: only the ask counts
                await c.get(url)
    assert [(method, target) for method, target, _ in fp.seen] == [asked]


def test_idle_connections_expire_before_the_common_servers_close_them() -> None:
    # uvicorn's and Node's keep-alive timeout is 5 s: a connection reused in the instant the
    # server closes it costs that request a retry; the default expiry stays under it.
    assert Transport().expiry < 5.0


async def test_chunked_request_body_is_framed() -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b"one,"
        yield b"two"

    async with serve(keep_alive_echo) as server, client(Transport()) as c:
        r = await c.post(server.url, content=parts())
        assert r.content == b"echo:one,two"


async def test_chunked_response_body_and_reuse_after_it() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"data: a\n\n", b"data: b\n\n"):
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await w.drain()
            w.write(b"0\r\n\r\n")
            await w.drain()

    async with serve(handler) as server, client(Transport()) as c:
        for _ in range(2):
            async with c.stream("GET", server.url) as r:
                body = b"".join([chunk async for chunk in r.aiter_raw()])
            assert body == b"data: a\n\ndata: b\n\n"
        assert server.connections == 1


async def test_body_delimited_by_close_is_read_to_the_end_and_not_reused() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await w.drain()

    transport = Transport()
    async with serve(handler) as server, client(transport) as c:
        assert (await c.get(server.url)).content == b"all of it"
        assert (await c.get(server.url)).content == b"all of it"
        assert server.connections == 2
        assert transport.idle() == 0


async def test_head_response_has_no_body() -> None:
    handler = answers_then_holds(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
    async with serve(handler) as server, client(Transport()) as c:
        r = await c.head(server.url)
        assert r.status_code == 200
        assert r.content == b""


async def test_interim_100_continue_is_skipped() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n" + content_length_response(b"final"))
        await w.drain()

    async with serve(handler) as server, client(Transport()) as c:
        r = await c.get(server.url)
        assert (r.status_code, r.content) == (200, b"final")


async def test_closing_an_unfinished_response_closes_the_connection_at_once() -> None:
    handler = answers_then_holds(FIRST_CHUNK)
    transport = Transport()
    async with serve(handler) as server, client(transport) as c:
        async with c.stream("GET", server.url) as r:
            chunks = r.aiter_raw()
            assert await anext(chunks) == b"first"
        # Not drained: the server never finished the body, yet it sees the close.
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)
        assert transport.in_use() == 0
        assert transport.idle() == 0


async def test_cancel_while_waiting_for_body_bytes_closes_the_connection_in_that_step() -> None:
    # The fence cancels a reader waiting for the next chunk: its connection is closed by the
    # cancellation itself, before anyone gets round to closing the response.
    transport = Transport()
    async with serve(answers_then_holds(FIRST_CHUNK)) as server, client(transport) as c:
        async with c.stream("GET", server.url) as r:
            chunks = r.aiter_raw()
            assert await anext(chunks) == b"first"
            waiting = asyncio.create_task(anext(chunks))
            await asyncio.sleep(0)  # it waits for bytes the server never sends
            assert transport.in_use() == 1
            waiting.cancel()
            await asyncio.wait({waiting}, timeout=GUARD)
            assert waiting.cancelled() and transport.in_use() == 0  # the response still open
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)


async def test_closing_the_transport_closes_its_connections_busy_or_idle() -> None:
    transport = Transport()
    async with serve(answers_then_holds(FIRST_CHUNK)) as server, client(transport) as c:
        async with c.stream("GET", server.url) as r:
            assert await anext(r.aiter_raw()) == b"first"
            await transport.aclose()  # a proxy shutting down
            await asyncio.wait_for(server.saw_eof.wait(), GUARD)
            assert transport.in_use() == 0


async def test_an_idle_connection_the_server_closes_leaves_the_pool() -> None:
    async def answers_then_closes(
        server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        await server.read_request(r)
        w.write(content_length_response(b"ok"))
        await w.drain()
        # returns: the connection is closed, idle in the client's pool by then

    transport = Transport()
    async with serve(answers_then_closes) as server, client(transport) as c:
        assert (await c.get(server.url)).content == b"ok"
        for _ in range(500):  # until the client's side has seen the close
            if transport.idle() == 0:
                break
            await asyncio.sleep(0.01)
        assert transport.idle() == 0 and transport.in_use() == 0


async def test_cancel_while_waiting_for_headers_closes_the_connection() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        await server.wait_eof(r)

    transport = Transport()
    async with serve(handler) as server, client(transport) as c:
        task = asyncio.create_task(c.get(server.url))
        await asyncio.wait_for(server.got_request.wait(), GUARD)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)
        assert transport.in_use() == 0


async def test_idle_pool_is_bounded() -> None:
    gate = asyncio.Event()

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            if len(server.requests) == 4:
                gate.set()
            await gate.wait()  # all four are in flight at once, on four connections
            w.write(content_length_response(b"ok"))
            await w.drain()

    transport = Transport(max_idle_per_host=2)
    async with serve(handler) as server, client(transport) as c:
        responses = await asyncio.gather(*(c.get(server.url) for _ in range(4)))
        assert [r.content for r in responses] == [b"ok"] * 4
        assert server.connections == 4
        assert transport.idle() == 2
        assert transport.in_use() == 0


async def test_connection_refused_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        async with client(Transport()) as c:
            with pytest.raises(httpx.ConnectError):
                await c.get(f"http://127.0.0.1:{port}/")
            with pytest.raises(UpstreamConnectError):
                with translate_errors("up"):
                    await c.get(f"http://127.0.0.1:{port}/")


async def test_close_before_any_response_is_a_protocol_error() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)

    async with serve(handler) as server, client(Transport()) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(server.url)


async def test_reset_mid_body_is_an_error_not_a_short_success() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..")
        await w.drain()
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()  # linger 0: an RST

    async with serve(handler) as server, client(Transport()) as c:
        with pytest.raises(UpstreamError):
            with translate_errors("up"):
                async with c.stream("GET", server.url) as r:
                    async for _ in r.aiter_raw():
                        pass


async def test_silence_past_the_read_timeout_is_a_read_timeout() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        await server.wait_eof(r)

    async with serve(handler) as server, client(Transport()) as c:
        with pytest.raises(UpstreamTimeout):
            with translate_errors("up"):
                await c.get(server.url, timeout=httpx.Timeout(GUARD, read=0.05))
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)


async def test_unsupported_scheme() -> None:
    async with client(Transport()) as c:
        with pytest.raises(httpx.UnsupportedProtocol):
            await c.get("ftp://127.0.0.1/")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_tls_against_a_self_signed_server(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with serve(keep_alive_echo, tls=server_ctx) as server:
        async with client(Transport(ssl_context=client_ctx)) as c:
            for _ in range(2):
                r = await c.post(server.url, content=b"secret")
                assert r.content == b"echo:secret"
            assert server.connections == 1
        # Without the CA the certificate is not trusted: a connect error, not a response.
        async with client(Transport()) as c:
            with pytest.raises(httpx.ConnectError):
                await c.post(server.url, content=b"secret")


@pytest.mark.parametrize("trust", ["default", "ca_bundle"])
async def test_tls_tells_the_upstream_by_alpn_that_it_speaks_http_1_1(
    trust: str, ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An upstream that offers HTTP/2 first learns from the handshake that the proxy speaks
    # HTTP/1.1, as from httpx's own transport and whatever CA setting is in use: a server
    # that insists on ALPN (or reads it) sees the same client either way.
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    server_ctx.set_alpn_protocols(["h2", "http/1.1"])
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    negotiated: list[str | None] = []

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        negotiated.append(w.get_extra_info("ssl_object").selected_alpn_protocol())
        await keep_alive_echo(server, r, w)

    if trust == "default":  # the system's CAs (which SSL_CERT_FILE stands in for here)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        transport = Transport()
    else:  # [server] ca_bundle
        transport = Transport(ssl_context=upstream.ssl_context_for(str(ca_file), {}))
    async with serve(handler, tls=server_ctx) as server, client(transport) as c:
        assert (await c.post(server.url, content=b"x")).content == b"echo:x"
    assert negotiated == ["http/1.1"]


async def test_a_connection_through_an_egress_tunnel_is_the_transports_to_close(
    ca: trustme.CA,
) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with (
        serve(answers_then_holds(FIRST_CHUNK), tls=server_ctx) as server,
        forward_proxy() as fp,
    ):
        overrides = {"upstream.url": server.url, "upstream.egress_proxy": fp.url}
        plan = egress.plan(load(env={}, overrides=overrides), {})
        transport = Transport(ssl_context=client_ctx, egress=plan)
        async with client(transport) as c, c.stream("GET", server.url) as r:
            assert await anext(r.aiter_raw()) == b"first"
            assert transport.in_use() == 1 and [m for m, _, _ in fp.seen] == ["CONNECT"]
            await transport.aclose()  # a proxy shutting down
            await asyncio.wait_for(server.saw_eof.wait(), GUARD)


async def test_the_shared_client_keeps_no_cookies_and_adds_no_headers() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            w.write(content_length_response(b"ok", b"set-cookie: session=caller-a; Path=/\r\n"))
            await w.drain()

    async with serve(handler) as server:
        c = create_client()
        try:
            for _ in range(2):
                request = httpx.Request(
                    "POST", server.url, headers={"x-caller": "a"}, content=b"{}"
                )
                response = await c.send(request, "up")
                assert response.headers["set-cookie"].startswith("session=caller-a")  # passed on
                await response.aclose()
        finally:
            await c.aclose()
    # Not the second caller's cookie, and none of httpx's client defaults: the upstream sees
    # what the caller sent, plus the Host and Content-Length every request needs.
    head = server.requests[1].split(b"\r\n\r\n")[0]
    names = [line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:]]
    assert sorted(n for n in names if n) == [b"content-length", b"host", b"x-caller"]


async def test_an_idle_connection_past_its_expiry_is_not_reused() -> None:
    async def echo_until_eof(
        server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        await keep_alive_echo(server, r, w)
        server.saw_eof.set()

    transport = Transport(keepalive_expiry=0.0)  # every idle connection has expired
    async with serve(echo_until_eof) as server, client(transport) as c:
        for _ in range(2):
            assert (await c.post(server.url, content=b"x")).content == b"echo:x"
        assert server.connections == 2
        # The expired one was closed when it was passed over, not left open to the end.
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)


async def test_silence_mid_body_past_the_read_timeout_is_a_read_timeout() -> None:
    handler = answers_then_holds(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n"
    )
    transport = Transport()
    async with serve(handler) as server, client(transport) as c:
        got: list[bytes] = []
        with pytest.raises(httpx.ReadTimeout):
            async with c.stream("GET", server.url, timeout=httpx.Timeout(GUARD, read=0.05)) as r:
                async for chunk in r.aiter_raw():
                    got.append(chunk)
        assert got == [b"one"]
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)  # and the connection is closed
        assert transport.in_use() == 0


async def test_the_read_timeout_is_per_read_not_for_the_whole_body() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(5):
            await asyncio.sleep(0.08)  # the pacing under test: each gap well inside 0.3 s
            w.write(b"1\r\nx\r\n")
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with serve(handler) as server, client(Transport()) as c:
        timeout = httpx.Timeout(GUARD, read=0.3)  # the whole body takes longer than this
        async with c.stream("GET", server.url, timeout=timeout) as r:
            assert b"".join([chunk async for chunk in r.aiter_raw()]) == b"xxxxx"


@pytest.mark.parametrize(
    ("kind", "expected"), [("fast", Transport), ("httpx", httpx.AsyncHTTPTransport)]
)
async def test_server_http_transport_picks_the_transport(kind: str, expected: type) -> None:
    client = create_client(kind=kind)
    try:
        assert isinstance(client.transport, expected)
    finally:
        await client.aclose()


async def test_the_default_transport_is_the_fast_one() -> None:
    config = load(env={}, overrides={"upstream.url": "http://127.0.0.1:9"})
    assert config.server.http_transport == "fast"
    client = create_client()
    try:
        assert isinstance(client.transport, Transport)
    finally:
        await client.aclose()


async def pieces_back_to_back(
    server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, count: int | None
) -> None:
    """A chunked SSE body of `count` events (None: until the client leaves), each its own
    write, one per loop iteration: a reader that keeps up reads them one by one."""
    await server.read_request(r)
    eof = asyncio.create_task(server.wait_eof(r))
    w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    i = 0
    while (count is None or i < count) and not (eof.done() or w.is_closing()):
        piece = b"data: %d\n\n" % i
        w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await asyncio.sleep(0)
        i += 1
    if not w.is_closing():
        w.write(b"0\r\n\r\n")
    await eof


@pytest.fixture
def paced_whatever_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every small read counts as back to back however slow a loaded machine makes the loop,
    # and a pause is long enough to gather many writes: what the tests see is the mechanism,
    # not the host's speed. bench B2 measures the shipped values.
    monkeypatch.setattr(pacing, "HOT_GAP", 60.0)
    monkeypatch.setattr(connection, "PAUSE", 0.02)


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("anyio_backend", ["asyncio", PROXY_LOOP], ids=["asyncio", "uvloop"])
@pytest.mark.usefixtures("paced_whatever_the_load")
async def test_a_body_written_in_small_pieces_back_to_back_is_read_whole_in_batches(
    tls: bool, ca: trustme.CA
) -> None:
    count = 600
    server_ctx = client_ctx = None
    if tls:  # the pause is the TLS transport's, over its socket's
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await pieces_back_to_back(server, r, w, count)

    async with serve(handler, tls=server_ctx) as server:
        async with client(Transport(ssl_context=client_ctx)) as c, c.stream("GET", server.url) as r:
            reads = [chunk async for chunk in r.aiter_raw()]
    assert b"".join(reads) == b"".join(b"data: %d\n\n" % i for i in range(count))
    # read as they came, that is a read or two per piece
    assert len(reads) < count / 10


@pytest.mark.parametrize("anyio_backend", ["asyncio", PROXY_LOOP], ids=["asyncio", "uvloop"])
@pytest.mark.usefixtures("paced_whatever_the_load")
async def test_a_response_closed_while_reading_pauses_closes_at_once_and_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connection, "PAUSE", 60.0)  # a pause the test would wait out

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await pieces_back_to_back(server, r, w, None)

    transport = Transport()
    async with serve(handler) as server:
        response = await transport.handle_async_request(httpx.Request("GET", server.url))
        body = response.stream
        assert isinstance(body, Body)
        for _ in range(1000):  # small reads until one pauses reading
            if body.conn._pausing is not None:
                break
            assert await asyncio.wait_for(body.read(), GUARD)
        assert body.conn._pausing is not None, "no pause in 1,000 small reads back to back"
        conn = weakref.ref(body.conn)
        await response.aclose()
        del response, body
        await asyncio.wait_for(server.saw_eof.wait(), GUARD)
        # Nothing (the pause's timer above all) holds the closed connection.
        assert conn() is None
        assert transport.in_use() == 0


class FakeTransport:
    """Only what a Connection does to its socket's reading."""

    def __init__(self) -> None:
        self.paused = False
        self.changes = 0

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        assert not self.paused, "paused twice"
        self.paused = True
        self.changes += 1

    def resume_reading(self) -> None:
        assert self.paused, "resumed while reading"
        self.paused = False
        self.changes += 1

    def close(self) -> None:
        pass


class NoPool:
    expiry = 4.0

    def forget(self, conn: connection.Connection) -> None:
        pass

    def release(self, conn: connection.Connection) -> None:
        pass


async def test_reading_resumes_only_once_both_the_pause_and_the_full_buffer_are_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pacing, "HOT_GAP", 60.0)
    resumed = asyncio.Event()
    over = connection.Connection._paused

    def paused(self: connection.Connection) -> None:
        over(self)
        resumed.set()

    monkeypatch.setattr(connection.Connection, "_paused", paused)
    sock = FakeTransport()
    conn = connection.Connection(NoPool(), ("http", "127.0.0.1", 1))
    conn.connection_made(sock)  # type: ignore[arg-type]
    await conn.send(httpx.Request("GET", "http://127.0.0.1:1/"), {})
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    piece = b"x" * (pacing.SMALL_READ - 100)

    async def small_reads_nobody_takes() -> None:
        """Reads back to back, as the socket gives them (none during a pause), until the
        buffer passes its high-water mark; that last read also starts a pause."""
        while conn.buffered <= connection.HIGH_WATER:
            if conn._pausing is not None:
                resumed.clear()
                await asyncio.wait_for(resumed.wait(), GUARD)
            assert not sock.paused
            conn.data_received(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert sock.paused and conn.reading_paused and conn._pausing is not None
        resumed.clear()

    await small_reads_nobody_takes()
    assert conn.take() is not None
    assert sock.paused, "taking the buffer resumed reading in the middle of a pause"
    await asyncio.wait_for(resumed.wait(), GUARD)
    assert not sock.paused

    await small_reads_nobody_takes()
    await asyncio.wait_for(resumed.wait(), GUARD)
    assert sock.paused, "the pause's end resumed reading with the buffer over its mark"
    assert conn.take() is not None
    assert not sock.paused
    conn.close()


TCP_ESTABLISHED, TCP_FIN_WAIT1, TCP_FIN_WAIT2 = 1, 4, 5  # linux/tcp_states.h


def tcp_state(fd: int) -> int:
    """The TCP state of the socket behind `fd` (TCP_INFO's first byte): closes `fd`."""
    with socket.socket(fileno=fd) as sock:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("anyio_backend", ["asyncio", PROXY_LOOP], ids=["asyncio", "uvloop"])
async def test_an_aborted_response_sends_its_fin_in_the_callers_own_step(
    tls: bool, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    # A fence is over when the upstream sees its connection end: uvloop closes a socket
    # only when the loop next runs its callbacks, so abort shuts it down itself. Over TLS
    # the shutdown comes before TLS's own close_notify, which then cannot be sent: quietly.
    server_ctx = client_ctx = None
    if tls:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
    async with serve(answers_then_holds(FIRST_CHUNK), tls=server_ctx) as server:
        c = create_client(Transport(ssl_context=client_ctx))
        try:
            response = await c.send(httpx.Request("POST", server.url, content=b"{}"), "up")
            own = upstream._own_body(response)
            assert own is not None
            socket_of = own[0].conn.transport.get_extra_info("socket")
            before, after = os.dup(socket_of.fileno()), os.dup(socket_of.fileno())
            assert tcp_state(before) == TCP_ESTABLISHED
            assert upstream.abort(response)
            assert tcp_state(after) in (TCP_FIN_WAIT1, TCP_FIN_WAIT2)  # nothing awaited yet
            await asyncio.wait_for(server.saw_eof.wait(), GUARD)
            await response.aclose()
        finally:
            await c.aclose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
