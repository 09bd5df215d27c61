"""proxy.upstream.routing: which upstream a path goes to, and which headers cross the proxy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.schema import UpstreamConfig
from proxy.errors import BadRequest, NoRoute
from proxy.upstream.routing import HOP_BY_HOP, Router, build_url, request_headers, response_headers


def up(prefix: str, url: str, name: str | None = None) -> UpstreamConfig:
    return UpstreamConfig(url=url, prefix=prefix, name=name or prefix)


ROUTER = Router(
    [
        up("/", "http://default.test", "default"),
        up("/openai", "https://api.openai.test", "openai"),
        up("/openai/v2/", "https://v2.openai.test/base", "openai-v2"),
        up("/anthropic/", "https://api.anthropic.test/", "anthropic"),
        up("/gw", "https://gateway.test/tenant-a/v1", "gateway"),
    ]
)


@pytest.mark.parametrize(
    ("path", "name", "upstream_path", "url"),
    [
        (
            "/v1/chat/completions",
            "default",
            "/v1/chat/completions",
            "http://default.test/v1/chat/completions",
        ),
        (
            "/openai/v1/chat/completions",
            "openai",
            "/v1/chat/completions",
            "https://api.openai.test/v1/chat/completions",
        ),
        ("/openai", "openai", "/", "https://api.openai.test/"),
        ("/openai/", "openai", "/", "https://api.openai.test/"),
        # The longest prefix wins, in whatever order the config lists them.
        (
            "/openai/v2/responses",
            "openai-v2",
            "/responses",
            "https://v2.openai.test/base/responses",
        ),
        ("/openai/v2", "openai-v2", "/", "https://v2.openai.test/base/"),
        ("/openai/v20/x", "openai", "/v20/x", "https://api.openai.test/v20/x"),
        # A prefix never matches a longer segment.
        (
            "/openaix/v1/models",
            "default",
            "/openaix/v1/models",
            "http://default.test/openaix/v1/models",
        ),
        (
            "/anthropic/v1/messages",
            "anthropic",
            "/v1/messages",
            "https://api.anthropic.test/v1/messages",
        ),
        (
            "/anthropicv1/messages",
            "default",
            "/anthropicv1/messages",
            "http://default.test/anthropicv1/messages",
        ),
        # A base URL with a path keeps it.
        (
            "/gw/chat/completions",
            "gateway",
            "/chat/completions",
            "https://gateway.test/tenant-a/v1/chat/completions",
        ),
        # Percent-encoding is kept as the client sent it.
        (
            "/gw/files/a%2Fb%20c",
            "gateway",
            "/files/a%2Fb%20c",
            "https://gateway.test/tenant-a/v1/files/a%2Fb%20c",
        ),
    ],
)
def test_route(path: str, name: str, upstream_path: str, url: str) -> None:
    route = ROUTER.route(path, "")
    assert (route.upstream.name, route.path, route.url) == (name, upstream_path, url)


def test_query_is_kept() -> None:
    route = ROUTER.route("/gw/models/x:streamGenerateContent", "alt=sse&key=k%20v")
    assert (
        route.url
        == "https://gateway.test/tenant-a/v1/models/x:streamGenerateContent?alt=sse&key=k%20v"
    )
    assert route.path == "/models/x:streamGenerateContent"


@pytest.mark.parametrize("order", [1, -1])
def test_longest_prefix_wins_whatever_the_order(order: int) -> None:
    ups = [up("/", "http://a.test"), up("/a", "http://b.test"), up("/a/b", "http://c.test")]
    router = Router(ups[::order])
    assert router.route("/a/b/c", "").url == "http://c.test/c"
    assert router.route("/a/c", "").url == "http://b.test/c"
    assert router.route("/c", "").url == "http://a.test/c"


@pytest.mark.parametrize(
    "path",
    [
        "/..",
        "/../etc/passwd",
        "/openai/../anthropic/v1/messages",
        "/gw/..",
        "/gw/./x",
        "/gw/.",
        "/gw/%2e%2e/tenant-b/v1/x",
        "/gw/%2E%2E/x",
        "/gw/.%2e/x",
        "/gw/%2e/x",
    ],
)
def test_dot_segments_are_refused(path: str) -> None:
    with pytest.raises(BadRequest, match="dot segments"):
        ROUTER.route(path, "")


@pytest.mark.parametrize(
    "path", ["/gw/..x", "/gw/x..", "/gw/.well-known/x", "/gw/a.b/c", "/gw/...", "/gw/%2e%2e%2e"]
)
def test_dots_inside_a_segment_are_fine(path: str) -> None:
    assert ROUTER.route(path, "").upstream.name == "gateway"


def test_no_match_is_no_route() -> None:
    router = Router([up("/openai", "http://a.test"), up("/anthropic", "http://b.test")])
    for path in ("/", "/v1/chat/completions", "/openaix", "/anthropi"):
        with pytest.raises(NoRoute):
            router.route(path, "")
    with pytest.raises(NoRoute):
        Router([]).route("/", "")


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.lists(st.sampled_from(["a", "b", "ab", "v1"]), min_size=1, max_size=3),
    rest=st.lists(st.sampled_from(["a", "b", "ab", "v1", "x", ""]), max_size=4),
)
def test_routed_url_is_always_under_the_matched_base(prefix: list[str], rest: list[str]) -> None:
    base = "https://host.test/base"
    router = Router([up("/" + "/".join(prefix), base)])
    path = "/" + "/".join([*prefix, *rest])
    route = router.route(path, "")
    assert route.url.startswith(base + "/")
    assert route.path == path[len("/" + "/".join(prefix)) :] or route.path == "/"


def test_build_url() -> None:
    assert build_url("http://h.test/", "/x", "") == "http://h.test/x"
    assert build_url("http://h.test/api/", "/x", "a=1") == "http://h.test/api/x?a=1"


# --- headers ------------------------------------------------------------------------------

CLIENT = [
    (b"host", b"127.0.0.1:8787"),
    (b"content-length", b"12"),
    (b"connection", b"keep-alive, X-Secret-Hop"),
    (b"x-secret-hop", b"1"),
    (b"keep-alive", b"timeout=5"),
    (b"transfer-encoding", b"chunked"),
    (b"te", b"trailers"),
    (b"upgrade", b"h2c"),
    (b"proxy-authorization", b"Basic abc"),
    (b"proxy-connection", b"keep-alive"),
    (b"trailer", b"x"),
    (b"authorization", b"Bearer sk"),
    (b"content-type", b"application/json"),
    (b"x-turn-id", b"t1"),
    (b"x-streamfence-token", b"secret"),
    (b"accept", b"text/event-stream"),
    (b"x-dup", b"1"),
    (b"x-dup", b"2"),
]


def test_request_headers_drop_hop_by_hop_connection_listed_host_length_and_given() -> None:
    out = request_headers(list(CLIENT), [b"x-turn-id", b"x-streamfence-token"])
    assert out == [
        (b"authorization", b"Bearer sk"),
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
        (b"x-dup", b"1"),
        (b"x-dup", b"2"),
    ]


def test_request_headers_without_a_drop_set_keep_end_to_end_ones() -> None:
    names = [n for n, _ in request_headers(list(CLIENT))]
    assert b"x-turn-id" in names and b"x-streamfence-token" in names
    assert not set(names) & (HOP_BY_HOP | {b"host", b"content-length", b"x-secret-hop"})


def test_connection_header_tokens_in_several_headers() -> None:
    headers = [
        (b"connection", b"x-a"),
        (b"connection", b" X-B ,,close"),
        (b"x-a", b"1"),
        (b"x-b", b"1"),
        (b"x-c", b"1"),
    ]
    assert request_headers(headers) == [(b"x-c", b"1")]
    assert response_headers(headers, reframed=False) == [(b"x-c", b"1")]


UPSTREAM = [
    (b"content-type", b"text/event-stream"),
    (b"content-length", b"100"),
    (b"content-encoding", b"gzip"),
    (b"transfer-encoding", b"chunked"),
    (b"connection", b"close"),
    (b"keep-alive", b"timeout=5"),
    (b"x-request-id", b"req_1"),
    (b"set-cookie", b"a=1"),
    (b"set-cookie", b"b=2"),
]


def test_response_headers_drop_length_and_encoding_only_when_reframed() -> None:
    kept = [
        (b"x-request-id", b"req_1"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]
    assert response_headers(list(UPSTREAM), reframed=True) == [
        (b"content-type", b"text/event-stream"),
        *kept,
    ]
    assert response_headers(list(UPSTREAM), reframed=False) == [
        (b"content-type", b"text/event-stream"),
        (b"content-length", b"100"),
        (b"content-encoding", b"gzip"),
        *kept,
    ]
