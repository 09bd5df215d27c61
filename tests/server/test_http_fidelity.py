"""HTTP fidelity (CONTRACT section 5, issue 12): header names in any case, one header per
name as the client sees it, Expect: 100-continue, content codings, and upstream failures
whose log line names the cause and the address."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import ssl
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import brotli
import httpx
import pytest
import trustme
import zstandard

from proxy.ops import logs
from proxy.ops.record import Record
from proxy.upstream import causes
from proxy.upstream.routing import request_headers, response_headers
from proxy.wire import codings
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body
from tests.stress import harness

CHAT = "/v1/chat/completions"
PLAIN = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'

# --- pure: header names in any case ---------------------------------------------------


def test_request_headers_compare_names_in_any_case() -> None:
    given = [
        (b"Connection", b"X-Hop, keep-alive"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"5"),
        (b"Host", b"proxy"),
        (b"Expect", b"100-continue"),
        (b"X-Turn-Id", b"t"),
        (b"Authorization", b"Bearer k"),
    ]
    assert request_headers(given, [b"x-turn-id"]) == [(b"Authorization", b"Bearer k")]


def test_response_headers_compare_names_in_any_case_and_come_out_lower_case() -> None:
    given = [
        (b"Content-Type", b"text/event-stream"),
        (b"Content-Encoding", b"gzip"),
        (b"Content-Length", b"42"),
        (b"Connection", b"X-Hop"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Cache-Control", b"no-transform"),
        (b"X-Accel-Buffering", b"yes"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
    ]
    assert response_headers(given, reframed=True) == [
        (b"content-type", b"text/event-stream"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]
    assert response_headers(given, reframed=False) == [
        (b"content-type", b"text/event-stream"),
        (b"content-encoding", b"gzip"),
        (b"content-length", b"42"),
        (b"cache-control", b"no-transform"),
        (b"x-accel-buffering", b"yes"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]


ALL = frozenset({b"gzip", b"deflate", b"br", b"zstd"})


@pytest.mark.parametrize(
    ("given", "decodable", "offered"),
    [
        (b"gzip, deflate, br, zstd", ALL, b"gzip, deflate, br, zstd"),
        (b"gzip, deflate, br, zstd", frozenset({b"gzip", b"deflate"}), b"gzip, deflate"),
        (b"ZSTD;q=1.0, snappy, compress;q=0.5, gzip;q=0.2", ALL, b"ZSTD;q=1.0, gzip;q=0.2"),
        (b"snappy", ALL, b"identity"),
        (b"identity", ALL, b"identity"),
        (b"br, *;q=0.1", ALL, b"br, deflate;q=0.1, gzip;q=0.1, zstd;q=0.1"),
        (b"gzip, *;q=0", ALL, b"gzip"),
        (b"", ALL, b"identity"),
    ],
)
def test_accept_encoding_offers_only_what_the_proxy_decodes(
    given: bytes, decodable: frozenset[bytes], offered: bytes
) -> None:
    assert codings.offer(given, decodable) == offered


def test_br_and_zstd_are_decodable_here() -> None:
    # Dependencies of the project: an agent's `zstd` and `br` offers are honoured.
    assert codings.DECODABLE == ALL


# --- over real HTTP ---------------------------------------------------------------------


async def test_upstream_sees_no_expect_and_the_whole_body_after_100_continue(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and waits for the 100."""
    body = json.dumps(chat_body("x" * 4096, stream=False) | {"stream": False}).encode()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % (CHAT.encode(), len(body))
    )
    await writer.drain()
    async with asyncio.timeout(5):
        interim = await reader.readuntil(b"\r\n\r\n")
    assert interim.startswith(b"HTTP/1.1 100 ")  # the proxy asked for the body itself
    writer.write(body)
    async with asyncio.timeout(5):
        response = await reader.read()
    writer.close()
    assert response.startswith(b"HTTP/1.1 200 ")
    seen = (await upstream.wait_requests(1))[0]
    assert "expect" not in seen.headers
    assert seen.body == body


async def test_upstream_is_offered_only_decodable_codings(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    headers = {"Accept-Encoding": "gzip, deflate, br, zstd, snappy"}
    async with proxy.client() as client:
        r = await client.post(CHAT, json=chat_body(), headers=headers)
    assert r.status_code == 200
    assert upstream.seen[0].headers["accept-encoding"] == "gzip, deflate, br, zstd"


COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
    "br": brotli.compress,
    "gzip": gzip.compress,
    "deflate": zlib.compress,
}


@pytest.mark.parametrize("coding", sorted(COMPRESS))
async def test_an_encoded_event_stream_goes_out_plain_and_labelled_so(
    proxy: Proxy, upstream: ScriptedUpstream, coding: str
) -> None:
    data = COMPRESS[coding](PLAIN)
    upstream.default.raw_bytes = [data[:7], data[7:]]  # a coding's frame split across reads
    upstream.default.headers = {"Content-Encoding": coding, "Cache-Control": "no-transform"}
    async with (
        proxy.client() as client,
        client.stream("POST", CHAT, json=chat_body(), headers={"Accept-Encoding": coding}) as r,
    ):
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
    assert raw == PLAIN
    assert "content-encoding" not in r.headers and "content-length" not in r.headers
    assert r.headers.get_list("cache-control") == ["no-cache"]
    assert r.headers.get_list("x-accel-buffering") == ["no"]


async def test_a_non_event_stream_body_in_zstd_passes_byte_for_byte(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    body = chat_body(stream=False, headers={"Content-Encoding": "zstd"})
    body["stream"] = False
    async with proxy.client() as client, client.stream("POST", CHAT, json=body) as r:
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", upstream.url + CHAT, json=body) as direct:
            direct_raw = b"".join([chunk async for chunk in direct.aiter_raw()])
    # Labelled zstd but not zstd at all: the proxy did not even try to decode it.
    assert r.headers["content-encoding"] == "zstd"
    assert raw == direct_raw and r.headers["content-length"] == str(len(raw))


# --- errors with causes ------------------------------------------------------------------


async def _failed(make_proxy: ProxyFactory, url: str, **overrides: object) -> Record:
    async with make_proxy(url, **overrides) as p:
        harness.watch(p.runtime)
        async with p.client() as client:
            r = await client.post(CHAT, json=chat_body(), headers={"X-Turn-Id": "cause"})
        (record,) = await harness.settled(p.runtime, 1)
    assert r.status_code in (502, 504)
    assert len(r.json()["error"]["message"]) < 120  # the client's error stays short
    assert json.loads(logs.line(record))["cause"] == record.cause  # logged
    return record


@pytest.mark.parametrize("kind", ["fast", "httpx"])
async def test_connection_refused_names_the_cause_and_address(
    make_proxy: ProxyFactory, kind: str
) -> None:
    port = free_port()
    record = await _failed(
        make_proxy, f"http://127.0.0.1:{port}", **{"server.http_transport": kind}
    )
    assert record.cause == f"127.0.0.1:{port}: connection refused"


@pytest.mark.parametrize("kind", ["fast", "httpx"])
async def test_unresolvable_name_names_the_cause(make_proxy: ProxyFactory, kind: str) -> None:
    record = await _failed(
        make_proxy, "http://nonexistent.invalid:8080", **{"server.http_transport": kind}
    )
    assert record.cause.startswith("nonexistent.invalid:8080: name not resolved")


@asynccontextmanager
async def tls_server(ca: trustme.CA) -> AsyncIterator[int]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(1)
        except (ssl.SSLError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["fast", "httpx"])
async def test_tls_verification_failure_says_why(make_proxy: ProxyFactory, kind: str) -> None:
    async with tls_server(trustme.CA()) as port:  # a CA the proxy does not trust
        record = await _failed(
            make_proxy, f"https://127.0.0.1:{port}", **{"server.http_transport": kind}
        )
    assert record.cause.startswith(f"127.0.0.1:{port}: TLS verification failed: ")
    assert "certificate" in record.cause  # OpenSSL's reason: unable to get local issuer...


@asynccontextmanager
async def scripted_socket(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_read_timeout_names_the_cause(make_proxy: ProxyFactory) -> None:
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await done.wait()

    async with scripted_socket(silent) as url:
        record = await _failed(make_proxy, url, **{"upstream.idle_timeout": 0.3})
        done.set()
    assert record.cause.endswith(": read timeout") and record.error == "upstream_timeout"


async def test_reset_mid_stream_names_the_cause(make_proxy: ProxyFactory) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n10\r\ndata: {"n": 1}\n\n\r\n'
        )
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # linger 0: an RST, not a FIN

    async with scripted_socket(reset) as url, make_proxy(url) as p:
        harness.watch(p.runtime)
        body = b""
        async with p.client() as client, client.stream("POST", CHAT, json=chat_body()) as r:
            with pytest.raises(httpx.RemoteProtocolError):  # cut, as the upstream's was
                async for chunk in r.aiter_raw():
                    body += chunk
        (record,) = await harness.settled(p.runtime, 1)
    assert b'"n": 1' in body and b"upstream_error" in body  # the event, then an error frame
    port = url.rsplit(":", 1)[1]
    assert record.cause.startswith(f"127.0.0.1:{port}: ")
    assert "reset" in record.cause or "ended early" in record.cause


def test_causes_never_show_userinfo() -> None:
    exc = httpx.ConnectError("could not reach http://user:s3cret@proxy.corp:3128/")
    assert "s3cret" not in causes.describe(exc, "h:1")
    assert causes.scrub("see https://a:b@h/x and http://tok@h") == "see https://h/x and http://h"
