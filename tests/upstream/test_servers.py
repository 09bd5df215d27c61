"""Upstreams that are not the project's Python test server (issue 12): Node's `http`
(tests/node_upstream.js), nginx serving a gzip-compressed event stream (gzip_static and
gzip on), and a raw socket writing Go-style canonical header names. Each capitalises
Content-Encoding, Content-Length, Connection, Keep-Alive or Transfer-Encoding; through the
proxy the client must still get plain events, one cache-control, no hop-by-hop header, and
non-SSE bodies byte for byte."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.upstream import connection, pacing
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import free_port
from tests.sse_client import chat_body, events, open_stream

CHAT = "/v1/chat/completions"
HERE = Path(__file__).resolve().parents[1]  # tests/, where node_upstream.js lives
HOP = {"connection", "keep-alive", "transfer-encoding", "x-hop"}


async def sse_via(proxy: Proxy, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytes]:
    """One streamed request through the proxy: the response and its raw body bytes."""
    async with proxy.client() as client, client.stream(method, path, **kw) as r:
        return r, b"".join([chunk async for chunk in r.aiter_raw()])


def assert_plain_event_stream(r: httpx.Response) -> None:
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "content-encoding" not in r.headers and "content-length" not in r.headers
    assert r.headers.get_list("cache-control") == ["no-cache"]
    assert r.headers.get_list("x-accel-buffering") == ["no"]
    assert not HOP & {k.lower() for k in r.headers if k.lower() != "transfer-encoding"}


# --- Node ----------------------------------------------------------------------------------


@asynccontextmanager
async def node_upstream() -> AsyncIterator[str]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (scripts/test installs nodejs)")
    proc = await asyncio.create_subprocess_exec(
        node,
        str(HERE / "node_upstream.js"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        async with asyncio.timeout(20):
            port = json.loads(await proc.stdout.readline())["port"]
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await proc.wait()


async def node_seen(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        seen: list[dict[str, Any]] = (await client.get(url + "/_stats")).json()["seen"]
        return seen


async def test_a_node_stream_superseded_is_closed_at_node_and_its_client_told(
    make_proxy: ProxyFactory,
) -> None:
    # The fence shuts the old upstream socket down itself (Connection.abort): Node must see
    # its response's connection end, and the newer request be answered on the same turn.
    turn = {"X-Turn-Id": "node-turn"}
    async with node_upstream() as url, make_proxy(url) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            held = {**turn, "x-hold": "old"}
            old = await open_stream(stack, client, CHAT, chat_body("old"), held)
            old_events = events(old)
            assert "n0" in (await anext(old_events)).data
            newer = await client.post(CHAT, json=chat_body("new"), headers=turn)
            assert newer.status_code == 200 and newer.text.endswith("data: [DONE]\n\n")
            rest = [e async for e in old_events]
            assert "stream_superseded" in rest[-1].data
            # Node answers this once the held stream's connection has ended.
            closed = await asyncio.wait_for(client.get(url + "/_closed/old"), 10)
            assert closed.text == "closed"


@pytest.mark.parametrize(
    ("offered", "chosen"), [("zstd, br, gzip", "br"), ("gzip", "gzip"), ("identity", None)]
)
async def test_node_event_stream_in_any_coding_goes_out_plain(
    make_proxy: ProxyFactory, offered: str, chosen: str | None
) -> None:
    async with node_upstream() as url, make_proxy(url) as p:
        r, body = await sse_via(
            p, "POST", CHAT, json=chat_body(), headers={"Accept-Encoding": offered}
        )
        seen = await node_seen(url)
    assert_plain_event_stream(r)
    assert r.headers["x-upstream"] == "node"
    assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
    assert seen[0]["headers"]["accept-encoding"] == offered  # all of them decodable
    assert seen[0]["encoding"] == chosen  # and Node compressed with what it chose


@pytest.mark.parametrize("offered", ["gzip", "identity"])
async def test_a_long_node_stream_written_event_by_event_arrives_whole_read_in_batches(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, offered: str
) -> None:
    # Node writes (and, compressed, flushes) each event on its own, a loop turn apart: the
    # proxy reads such a body in batches (proxy/upstream/pacing.py), and every event must come out
    # once, in order, whatever Node's framing of its chunks. Every read after the first is
    # paced here, whatever the machine's timing (on a loaded one, Node's writes may arrive
    # gathered and never come back to back): this is about Node's framing across the
    # pauses; when pacing starts is tests/upstream/test_pacing.py's.
    monkeypatch.setattr(pacing, "HOT_GAP", 60.0)
    monkeypatch.setattr(pacing, "HOT_READS", 1)
    pauses = 0
    pause = connection.Connection._pause_briefly

    def counted(self: connection.Connection) -> None:
        nonlocal pauses
        pauses += 1
        pause(self)

    monkeypatch.setattr(connection.Connection, "_pause_briefly", counted)
    count = 2000
    async with node_upstream() as url, make_proxy(url) as p:
        r, body = await sse_via(
            p,
            "POST",
            CHAT,
            json=chat_body(),
            headers={"Accept-Encoding": offered, "X-Events": str(count)},
        )
    assert_plain_event_stream(r)
    contents = [
        json.loads(line[6:])["choices"][0]["delta"]["content"]
        for line in body.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert contents == [f"n{i} " for i in range(count)]
    assert body.endswith(b"data: [DONE]\n\n")
    assert pauses > 0  # it was read in batches, and resumed after each


async def test_node_keep_alive_connection_is_reused_and_its_headers_stay_hop_by_hop(
    make_proxy: ProxyFactory,
) -> None:
    async with node_upstream() as url, make_proxy(url) as p:
        first, _ = await sse_via(p, "POST", CHAT, json=chat_body("a"))
        second, _ = await sse_via(p, "POST", CHAT, json=chat_body("b"))
        seen = await node_seen(url)
    assert_plain_event_stream(first)
    assert_plain_event_stream(second)
    # Node says Keep-Alive: timeout=5; the pool keeps the connection 4 s, so both went on one.
    assert [s["port"] for s in seen][0] == seen[1]["port"]


async def test_node_compressed_json_passes_byte_for_byte(make_proxy: ProxyFactory) -> None:
    async with node_upstream() as url, make_proxy(url) as p:
        got = []
        for base in (url, p.url):
            async with (
                httpx.AsyncClient(base_url=base) as client,
                client.stream("GET", "/v1/models", headers={"Accept-Encoding": "br"}) as r,
            ):
                raw = b"".join([chunk async for chunk in r.aiter_raw()])
                got.append((r.headers["content-encoding"], r.headers["content-length"], raw))
    assert got[0] == got[1] and got[0][0] == "br"


# --- nginx -----------------------------------------------------------------------------------

NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    types {{ text/event-stream sse; }}
    server {{
        listen 127.0.0.1:{port};
        root {dir}/www;
        location /static/ {{ gzip_static on; }}
        location /dynamic/ {{ gzip on; gzip_types text/event-stream; gzip_min_length 1; }}
    }}
}}
"""
EVENTS = b"".join(b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * 200) for i in range(50))
EVENTS += b"data: [DONE]\n\n"


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def _nginx_files(root: Path, port: int) -> Path:
    for where in ("static", "dynamic"):
        (root / "www" / where).mkdir(parents=True)
        (root / "www" / where / "stream.sse").write_bytes(EVENTS)
    (root / "www" / "static" / "stream.sse.gz").write_bytes(gzip.compress(EVENTS))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # nginx's workers may run as nobody
    for parent in root.parents:  # ... and must get through pytest's private tmp directory
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o111)
    conf = root / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=root, port=port))
    return conf


@pytest.fixture
async def nginx(tmp_path: Path) -> AsyncIterator[str]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed (scripts/test installs nginx-light)")
    port = free_port()
    conf = _nginx_files(tmp_path, port)
    proc = await asyncio.create_subprocess_exec(
        binary,
        "-c",
        str(conf),
        "-p",
        str(tmp_path),
        "-g",
        "daemon off;",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    w.close()
                    break
                except OSError:
                    if proc.returncode is not None:
                        pytest.fail((tmp_path / "error.log").read_text())
                    await asyncio.sleep(0.02)  # polling a port another process opens
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGQUIT)
        await proc.wait()


@pytest.mark.parametrize("where", ["static", "dynamic"])
async def test_nginx_gzip_event_stream_is_decoded_and_goes_out_plain(
    nginx: str, make_proxy: ProxyFactory, where: str
) -> None:
    path = f"/{where}/stream.sse"
    async with httpx.AsyncClient() as client:
        direct = await client.get(nginx + path, headers={"Accept-Encoding": "gzip"})
    # What nginx sends: gzip, with Content-Length for gzip_static and chunked for gzip on.
    assert direct.headers["content-encoding"] == "gzip"
    assert ("content-length" in direct.headers) == (where == "static")
    async with make_proxy(nginx) as p:
        r, body = await sse_via(p, "GET", path, headers={"Accept-Encoding": "gzip, br, zstd"})
        _, body2 = await sse_via(p, "GET", path, headers={"Accept-Encoding": "gzip"})
    assert_plain_event_stream(r)
    assert body == body2 == EVENTS
    assert "etag" in {k.lower() for k in r.headers}  # the upstream's own headers still pass


# --- a raw socket with Go-style header names -----------------------------------------------------


class GoStyle:
    """Answers every request on a connection with `answer`, keep-alive, and counts both."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests += 1
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def go_style(answer: bytes) -> AsyncIterator[GoStyle]:
    server = GoStyle(answer)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        listener.close()


def _chunked(data: bytes, size: int = 40) -> bytes:
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%X\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


PLAIN = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
GZ = gzip.compress(PLAIN)
GO_ANSWERS = {
    "gzip-content-length": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\nCache-Control: no-cache, no-transform\r\n"
        b"Keep-Alive: timeout=5\r\nConnection: keep-alive\r\n\r\n%s" % (len(GZ), GZ)
    ),
    "gzip-chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: X-Hop\r\nX-Hop: 1\r\n"
        b"X-Accel-Buffering: yes\r\n\r\n" + _chunked(GZ)
    ),
    "plain-content-length": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n"
        b"Keep-Alive: timeout=5\r\n\r\n%s" % (len(PLAIN), PLAIN)
    ),
}


@pytest.mark.parametrize("answer", sorted(GO_ANSWERS))
@pytest.mark.parametrize("kind", ["fast", "httpx"])
async def test_go_style_header_names(make_proxy: ProxyFactory, answer: str, kind: str) -> None:
    async with (
        go_style(GO_ANSWERS[answer]) as server,
        make_proxy(server.url, **{"server.http_transport": kind}) as p,
    ):
        results = [await sse_via(p, "POST", CHAT, json=chat_body(str(i))) for i in range(2)]
    for r, body in results:
        assert_plain_event_stream(r)
        assert body == PLAIN
    assert server.requests == 2 and server.connections == 1  # kept alive and reused


async def test_go_style_compressed_json_passes_byte_for_byte(make_proxy: ProxyFactory) -> None:
    body = gzip.compress(b'{"object": "list", "data": []}')
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n%s"
        % (len(body), body)
    )
    async with go_style(answer) as server, make_proxy(server.url) as p:
        r, raw = await sse_via(p, "GET", "/v1/models")
    assert raw == body
    assert r.headers["content-encoding"] == "gzip"
    assert r.headers["content-length"] == str(len(body))
    assert "keep-alive" not in r.headers
