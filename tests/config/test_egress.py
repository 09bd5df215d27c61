"""Egress proxies and CA bundles (CONTRACT section 5): the upstream side honours
HTTPS_PROXY / HTTP_PROXY / ALL_PROXY / NO_PROXY and `egress_proxy` in the config, with both
transports. Behind it a small forward proxy written here (absolute-form requests and CONNECT
tunnels) and a TLS upstream on 127.0.0.1 signed by a throwaway CA (trustme)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trustme
import uvloop

from proxy import cli
from proxy.config import egress
from proxy.config.load import ConfigError, from_dict, load
from proxy.server import serve as proxy_serve
from proxy.upstream.client import ssl_context_for
from proxy.upstream.transport import Transport
from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream, free_port, serve
from tests.sse_client import chat_body, events
from tests.stress import harness

CHAT = "/v1/chat/completions"
SECRET = "pr0xy-S3CRET"
KINDS = ["fast", "httpx"]


class ForwardProxy:
    """An HTTP forward proxy on 127.0.0.1: absolute-form requests (one origin connection
    each) and CONNECT tunnels; optionally demanding credentials or refusing CONNECT."""

    def __init__(self, *, credentials: str | None = None, refuse_connect: bool = False) -> None:
        self.expected = (
            None
            if credentials is None
            else "Basic " + base64.b64encode(credentials.encode()).decode()
        )
        self.refuse_connect = refuse_connect
        self.seen: list[tuple[str, str, str | None]] = []  # method, target, credentials
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        fields = [line.split(":", 1) for line in lines[1:] if ":" in line]
        headers = {k.strip().lower(): v.strip() for k, v in fields}
        auth = headers.get("proxy-authorization")
        self.seen.append((method, target, auth))
        if self.expected is not None and auth != self.expected:
            writer.write(
                b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                b'Proxy-Authenticate: Basic realm="x"\r\nContent-Length: 0\r\n\r\n'
            )
            return True
        if method == "CONNECT":
            if self.refuse_connect:
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return True
            host, port = target.rsplit(":", 1)
            up_r, up_w = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await _pipe_both(reader, writer, up_r, up_w)
            return False
        # Absolute form: to the origin in origin form, without the proxy's own header.
        url = urlsplit(target)
        assert url.scheme == "http" and url.hostname == "127.0.0.1", target
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        kept = [line for line in lines[1:] if line and not line.lower().startswith("proxy-")]
        kept = [line for line in kept if not line.lower().startswith("connection:")]
        path = url.path + (f"?{url.query}" if url.query else "")
        up_r, up_w = await asyncio.open_connection(url.hostname, url.port)
        up_w.write(
            f"{method} {path} HTTP/1.1\r\n".encode()
            + "".join(f"{line}\r\n" for line in kept).encode("latin-1")
            + b"Connection: close\r\n\r\n"
            + body
        )
        while chunk := await up_r.read(65536):  # the origin closes after its response
            writer.write(chunk)
            await writer.drain()
        up_w.close()
        return True


async def _pipe_both(
    a_r: asyncio.StreamReader,
    a_w: asyncio.StreamWriter,
    b_r: asyncio.StreamReader,
    b_w: asyncio.StreamWriter,
) -> None:
    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with suppress(ConnectionError):
            while chunk := await src.read(65536):
                dst.write(chunk)
                await dst.drain()
        dst.close()

    await asyncio.gather(pipe(a_r, b_w), pipe(b_r, a_w))


@asynccontextmanager
async def forward_proxy(**kw: Any) -> AsyncIterator[ForwardProxy]:
    fp = ForwardProxy(**kw)
    server = await asyncio.start_server(fp.handle, "127.0.0.1", 0)
    fp.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield fp
    finally:
        server.close()


def with_credentials(url: str, credentials: str) -> str:
    return url.replace("http://", f"http://{credentials}@")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
async def tls_upstream(ca: trustme.CA, tmp_path: Path) -> AsyncIterator[ScriptedUpstream]:
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    scripted = ScriptedUpstream()
    async with serve(scripted, ssl_certfile=str(pem), ssl_keyfile=str(pem)) as (url, _):
        scripted.url = url.replace("http://", "https://")
        yield scripted


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> Iterator[Lines]:
    logger = logging.getLogger("streamfence")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def _stream(proxy_url: str) -> tuple[int, list[str]]:
    async with (
        httpx.AsyncClient(base_url=proxy_url, timeout=10, trust_env=False) as client,
        client.stream("POST", CHAT, json=chat_body()) as r,
    ):
        return r.status_code, [e.data async for e in events(r)]


# --- through the proxy ----------------------------------------------------------------


@pytest.mark.parametrize("source", ["server.egress_proxy", "HTTP_PROXY", "all_proxy"])
@pytest.mark.parametrize("kind", KINDS)
async def test_http_upstream_through_the_proxy_in_absolute_form_with_credentials(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    kind: str,
    source: str,
    log_lines: Lines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with forward_proxy(credentials=f"user:{SECRET}") as fp:
        config = {"server.http_transport": kind}
        proxy_url = with_credentials(fp.url, f"user:{SECRET}")
        if source.startswith("server."):
            config[source] = proxy_url
        else:
            monkeypatch.setenv(source, proxy_url)
            monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")  # for https:// only: unused
        async with make_proxy(upstream.url, **config) as p:
            status, got = await _stream(p.url)
            status2, _ = await _stream(p.url)
    assert status == status2 == 200 and got[-1] == "[DONE]"
    expected = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
    assert fp.seen[0] == ("POST", f"{upstream.url}{CHAT}", expected)
    assert len(upstream.seen) == 2
    assert "proxy-authorization" not in upstream.seen[0].headers
    assert not any(SECRET in line for line in log_lines.lines)


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "ALL_PROXY"])
@pytest.mark.parametrize("kind", KINDS)
async def test_https_upstream_through_a_connect_tunnel_from_the_environment(
    tls_upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    ca_file: str,
    kind: str,
    variable: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with forward_proxy() as fp:
        monkeypatch.setenv(variable, fp.url)
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # for http:// only: unused
        config = {"server.ca_bundle": ca_file, "server.http_transport": kind}
        async with make_proxy(tls_upstream.url, **config) as p:
            status, got = await _stream(p.url)
    assert status == 200 and got[-1] == "[DONE]"
    port = urlsplit(tls_upstream.url).port
    assert fp.seen == [("CONNECT", f"127.0.0.1:{port}", None)]
    assert len(tls_upstream.seen) == 1


async def test_lower_case_variable_and_ssl_cert_file_are_honoured(
    tls_upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    ca_file: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with forward_proxy() as fp:
        monkeypatch.setenv("https_proxy", fp.url)
        monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")  # lower case wins
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        async with make_proxy(tls_upstream.url) as p:
            status, _ = await _stream(p.url)
    assert status == 200 and [m for m, _, _ in fp.seen] == ["CONNECT"]


@pytest.fixture
def ca_dir(ca: trustme.CA, tmp_path: Path) -> str:
    """A directory of hashed CA certificates, as SSL_CERT_DIR and `openssl rehash` make."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    where = tmp_path / "certs"
    where.mkdir()
    ca.cert_pem.write_to_path(str(where / "test-ca.pem"))
    subprocess.run([openssl, "rehash", str(where)], check=True, capture_output=True)
    return str(where)


@pytest.mark.parametrize("how", ["SSL_CERT_DIR", "ca_bundle"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_directory_of_ca_certificates_is_honoured(
    tls_upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    ca_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    kind: str,
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # it would win over SSL_CERT_DIR
    config = {"server.http_transport": kind}
    if how == "SSL_CERT_DIR":
        monkeypatch.setenv("SSL_CERT_DIR", ca_dir)
    else:
        config["server.ca_bundle"] = ca_dir
    async with make_proxy(tls_upstream.url, **config) as p:
        status, got = await _stream(p.url)
    assert status == 200 and got[-1] == "[DONE]"


@pytest.mark.parametrize("tunnelled", [False, True])
async def test_without_the_ca_the_tls_upstream_is_refused(
    tls_upstream: ScriptedUpstream, make_proxy: ProxyFactory, tunnelled: bool
) -> None:
    """The control for the CA tests above: the system's certificates do not know trustme's,
    directly or inside a tunnel."""
    async with forward_proxy() as fp:
        config = {"server.egress_proxy": fp.url if tunnelled else "none"}
        r, cause = await _refused(make_proxy, tls_upstream.url, **config)
    assert r.status_code == 502 and "TLS verification failed" in cause
    assert [m for m, _, _ in fp.seen] == (["CONNECT"] if tunnelled else [])


@pytest.mark.parametrize("rule", ["127.0.0.1", "127.0.0.0/8", "*", "localhost,127.0.0.1"])
async def test_no_proxy_goes_direct(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    rule: str,
) -> None:
    async with forward_proxy() as fp:
        monkeypatch.setenv("ALL_PROXY", fp.url)
        monkeypatch.setenv("NO_PROXY", rule)
        async with make_proxy(upstream.url) as p:
            status, _ = await _stream(p.url)
    assert status == 200 and fp.seen == [] and len(upstream.seen) == 1


async def test_an_upstream_set_to_none_goes_direct_whatever_the_server_says(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with forward_proxy() as fp:
        config = {"server.egress_proxy": fp.url, "upstream.egress_proxy": "none"}
        async with make_proxy(upstream.url, **config) as p:
            status, _ = await _stream(p.url)
    assert status == 200 and fp.seen == []


# --- a proxy that fails ----------------------------------------------------------------


async def _refused(make_proxy: ProxyFactory, url: str, **config: Any) -> tuple[Any, str]:
    async with make_proxy(url, **config) as p:
        harness.watch(p.runtime)
        async with httpx.AsyncClient(base_url=p.url, timeout=10, trust_env=False) as client:
            r = await client.post(CHAT, json=chat_body())
        (record,) = await harness.settled(p.runtime, 1)
    return r, record.cause


@pytest.mark.parametrize("kind", KINDS)
async def test_a_proxy_refusing_connect_is_a_502_whose_cause_says_so(
    tls_upstream: ScriptedUpstream, make_proxy: ProxyFactory, ca_file: str, kind: str
) -> None:
    async with forward_proxy(refuse_connect=True) as fp:
        config = {
            "server.egress_proxy": fp.url,
            "server.ca_bundle": ca_file,
            "server.http_transport": kind,
        }
        r, cause = await _refused(make_proxy, tls_upstream.url, **config)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert "403" in cause and tls_upstream.seen == []
    if kind == "fast":
        assert f"egress proxy {urlsplit(fp.url).netloc} refused CONNECT" in cause


@pytest.mark.parametrize("tls", [True, False])
@pytest.mark.parametrize("kind", KINDS)
async def test_wrong_proxy_credentials_are_a_502_and_never_logged(
    tls_upstream: ScriptedUpstream,
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    ca_file: str,
    log_lines: Lines,
    kind: str,
    tls: bool,
) -> None:
    """CONNECT refused with 407, or a 407 to an absolute-form request: the proxy's answer,
    never passed to the client as if the upstream had sent it."""
    async with forward_proxy(credentials="user:right") as fp:
        config = {
            "server.egress_proxy": with_credentials(fp.url, f"user:{SECRET}"),
            "server.ca_bundle": ca_file,
            "server.http_transport": kind,
        }
        target = tls_upstream.url if tls else upstream.url
        r, cause = await _refused(make_proxy, target, **config)
    assert r.status_code == 502 and "407" in cause
    assert tls_upstream.seen == upstream.seen == []
    assert not any(SECRET in line for line in log_lines.lines)
    assert SECRET not in r.text


async def test_an_unreachable_proxy_is_a_502_naming_it(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    port = free_port()
    r, cause = await _refused(
        make_proxy, upstream.url, **{"server.egress_proxy": f"127.0.0.1:{port}"}
    )
    assert r.status_code == 502
    assert cause.endswith(
        f"could not connect to the egress proxy 127.0.0.1:{port}: connection refused"
    )


async def test_a_proxy_that_never_answers_connect_is_a_504_not_a_hang(
    tls_upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    accepted = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the proxy gives up and closes
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = {"server.egress_proxy": f"http://127.0.0.1:{port}", "upstream.connect_timeout": 0.3}
    try:
        r, cause = await _refused(make_proxy, tls_upstream.url, **config)
    finally:
        server.close()
    assert accepted.is_set()
    assert r.status_code == 504 and cause.endswith("connect timeout through the egress proxy")


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("socks5://127.0.0.1:1080", "only http:// egress proxies are supported, not socks5://"),
        ("http://user:pw@127.0.0.1:port", "port is not a number"),
        ("http://:8080", "has no host name"),
    ],
)
def test_a_malformed_proxy_url_is_a_config_error_without_its_credentials(
    setting: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict({"server": {"egress_proxy": setting}, "upstream": [{"url": "http://a"}]})
    assert info.value.problems == [
        f"server.egress_proxy: {info.value.problems[0].split(': ', 1)[1]}"
    ]
    assert problem in str(info.value) and "pw" not in str(info.value)


def test_a_malformed_proxy_variable_stops_startup_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "ftp://user:pw@proxy:21")
    assert cli.main(["--upstream", "https://api.example.com"]) == 2
    err = capsys.readouterr().err
    assert "config error: HTTPS_PROXY: only http:// egress proxies are supported" in err
    assert "pw" not in err


def _config(**overrides: str) -> Any:
    return load(env={}, overrides={"upstream.url": "https://api.example.com", **overrides})


@pytest.mark.parametrize("how", ["SSL_CERT_FILE", "--config"])
def test_unloadable_ca_certificates_stop_startup_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    how: str,
) -> None:
    bad = tmp_path / "not-a-cert.pem"
    bad.write_text("this is not PEM\n")
    args = ["--upstream", "https://api.example.com"]
    if how == "SSL_CERT_FILE":
        monkeypatch.setenv("SSL_CERT_FILE", str(bad))
        expected = "SSL_CERT_FILE: cannot load CA certificates"
    else:
        conf = tmp_path / "c.toml"
        conf.write_text(f'[server]\nca_bundle = "{bad}"\n')
        args += ["--config", str(conf)]
        expected = "server.ca_bundle: cannot load CA certificates"
    assert cli.main(args) == 2
    assert expected in capsys.readouterr().err


def test_startup_lines_name_the_proxy_without_credentials() -> None:
    lines = proxy_serve.startup_lines(
        _config(**{"server.egress_proxy": "http://u:pw@p:3128"}), environ={}
    )
    assert "  egress proxy for 'default': http://p:3128 (from server.egress_proxy)" in lines
    assert not any("pw" in line for line in lines)
    from_env = proxy_serve.startup_lines(
        _config(), environ={"https_proxy": "http://u:pw@corp:8080"}
    )
    assert "  egress proxy for 'default': http://corp:8080 (from HTTPS_PROXY)" in from_env
    bypassed = {"https_proxy": "http://corp:8080", "NO_PROXY": ".example.com"}
    direct = proxy_serve.startup_lines(_config(), environ={}) + proxy_serve.startup_lines(
        _config(), bypassed
    )
    assert not any("egress" in line for line in direct)


def test_origins_shared_by_upstreams_must_agree_on_their_proxy() -> None:
    with pytest.raises(ConfigError, match=r"upstream\[1\].egress_proxy: another upstream"):
        from_dict(
            {
                "upstream": [
                    {"name": "a", "prefix": "/a", "url": "https://h/x"},
                    {"name": "b", "prefix": "/b", "url": "https://h:443/y", "egress_proxy": "p:1"},
                ]
            }
        )


def test_a_missing_ca_bundle_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="server.ca_bundle: no such file"):
        from_dict(
            {"server": {"ca_bundle": str(tmp_path / "nope.pem")}, "upstream": [{"url": "http://a"}]}
        )


@pytest.mark.parametrize(
    ("rules", "host", "port", "matches"),
    [
        ("example.com", "api.example.com", 443, True),
        (".example.com", "example.com", 443, True),
        ("example.com", "badexample.com", 443, False),
        ("10.0.0.0/8", "10.1.2.3", 80, True),
        ("::1", "::1", 80, True),
        ("[::1]:8080", "::1", 80, False),
        ("h:8080", "h", 8080, True),
        ("h:8080", "h", 80, False),
        ("", "h", 80, False),
        (" A.example.COM ,x", "a.example.com", 1, True),
        ("*.example.com", "api.example.com", 443, True),
        ("[::1]", "::1", 80, True),
    ],
)
def test_no_proxy_rules(rules: str, host: str, port: int, matches: bool) -> None:
    assert egress.no_proxy_matches(rules, host, port) is matches


def test_the_proxy_url_never_shows_its_credentials() -> None:
    proxy = egress.parse_proxy_url("http://us%40er:p%3Aw@proxy:3128")
    assert proxy.authorization == b"Basic " + base64.b64encode(b"us@er:p:w")
    assert "p%3Aw" not in repr(proxy) and proxy.shown == "http://proxy:3128"
    assert json.dumps(proxy.address) == '"proxy:3128"'


def test_the_tunnel_works_on_uvloop_the_loop_the_proxy_runs_on(
    ca: trustme.CA, ca_file: str, tmp_path: Path
) -> None:
    """start_tls over a CONNECT tunnel, then the connection reused: on uvloop's transports,
    which differ from asyncio's (the suite's other tests run on asyncio's)."""
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))

    async def main() -> tuple[list[int], list[tuple[str, str, str | None]]]:
        scripted = ScriptedUpstream()
        async with (
            serve(scripted, ssl_certfile=str(pem), ssl_keyfile=str(pem)) as (url, _),
            forward_proxy() as fp,
        ):
            port = int(url.rsplit(":", 1)[1])
            choice = egress.Choice(egress.parse_proxy_url(fp.url), "test")
            plan = egress.EgressPlan({("https", "127.0.0.1", port): choice})
            transport = Transport(ssl_context=ssl_context_for(ca_file, {}), egress=plan)
            statuses = []
            async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
                for _ in range(2):
                    r = await client.post(f"https://127.0.0.1:{port}{CHAT}", json=chat_body())
                    assert "data: [DONE]" in r.text
                    statuses.append(r.status_code)
            return statuses, fp.seen

    statuses, seen = uvloop.run(main())
    assert statuses == [200, 200]
    assert [method for method, _, _ in seen] == ["CONNECT"]  # one tunnel, reused
