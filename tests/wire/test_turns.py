"""proxy.wire.turns: which requests are attempts of the same turn (CONTRACT section 3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.fingerprint import json_module_fingerprint
from proxy.errors import BadRequest
from proxy.wire.turns import (
    TurnKey,
    credential_scope,
    explicit_turn_id,
    fingerprint,
    resolve,
    split_query_turn,
)

HEADER = b"x-turn-id"
IGNORE = ("stream", "stream_options", "timeout")
BODY = {
    "model": "gpt-4o",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


def key(
    headers: list[tuple[bytes, bytes]] | None = None,
    body: Any = BODY,
    *,
    query: str = "",
    route: str = "default",
    path: str = "/v1/chat/completions",
    use_fingerprint: bool = True,
) -> TurnKey | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return resolve(
        list(headers or []),
        query,
        raw,
        header_name=HEADER,
        route=route,
        path=path,
        use_fingerprint=use_fingerprint,
        ignore_fields=IGNORE,
    )


# --- the explicit header ------------------------------------------------------------------


def test_explicit_turn_id_wins_over_the_fingerprint() -> None:
    a = key([(HEADER, b"turn-1")])
    b = key([(HEADER, b"turn-1")], {"messages": ["something else entirely"]})
    assert a is not None and b is not None and a.source == "header"
    assert a.key == b.key
    assert a.body_fingerprint != b.body_fingerprint  # the same turn, but not an identical request
    assert key([(HEADER, b"turn-2")]) != a
    fp = key()
    assert fp is not None and fp.source == "fingerprint" and fp != a


def test_explicit_turn_id_works_without_fingerprinting_and_without_a_body() -> None:
    a = key([(HEADER, b"t")], b"", use_fingerprint=False)
    assert a is not None and a.source == "header"
    assert key([], use_fingerprint=False) is None


@pytest.mark.parametrize("value", [b"none", b"NONE", b"None", b" none "])
def test_none_opts_out(value: bytes) -> None:
    assert key([(HEADER, value)]) is None


def test_surrounding_whitespace_is_not_part_of_the_id() -> None:
    assert key([(HEADER, b"  abc ")]) == key([(HEADER, b"abc")])


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ([(HEADER, b"")], "must not be empty"),
        ([(HEADER, b"   ")], "must not be empty"),
        ([(HEADER, b"x" * 257)], "over 256 bytes"),
        ([(HEADER, b"a\x00b")], "control characters"),
        ([(HEADER, b"a\x1fb")], "control characters"),
        ([(HEADER, b"a\tb")], "control characters"),
        ([(HEADER, b"a\x7fb")], "control characters"),
        ([(HEADER, b"a"), (HEADER, b"a")], "at most once"),
        ([(HEADER, b"none"), (HEADER, b"b")], "at most once"),
    ],
)
def test_bad_turn_ids_are_bad_requests(headers: list[tuple[bytes, bytes]], problem: str) -> None:
    with pytest.raises(BadRequest) as caught:
        key(headers)
    assert problem in caught.value.message
    assert caught.value.status == 400
    assert "x-turn-id" in caught.value.message


def test_turn_id_limits_are_exact() -> None:
    assert explicit_turn_id([(HEADER, b"x" * 256)], HEADER) == b"x" * 256
    assert explicit_turn_id([(HEADER, "caf\u00e9".encode())], HEADER) == "caf\u00e9".encode()
    assert explicit_turn_id([(b"other", b"x")], HEADER) is None


def test_header_name_is_configurable() -> None:
    headers = [(b"x-my-turn", b"t1")]
    assert explicit_turn_id(headers, b"x-my-turn") == b"t1"
    assert explicit_turn_id(headers, HEADER) is None


# --- the fingerprint ----------------------------------------------------------------------


def test_fingerprint_ignores_volatile_fields_key_order_and_whitespace() -> None:
    base = key()
    assert base is not None
    variants = [
        {**BODY, "stream": False},
        {k: v for k, v in BODY.items() if k != "stream"},
        {**BODY, "stream_options": {"include_usage": True}},
        {**BODY, "timeout": 30},
        dict(reversed(list(BODY.items()))),
    ]
    for variant in variants:
        same = key(body=variant)
        assert same is not None and same.key == base.key, variant
        assert same.body_fingerprint == base.body_fingerprint
    spaced = key(body=json.dumps(BODY, indent=4).encode())
    assert spaced is not None and spaced.key == base.key


def test_fingerprint_changes_with_messages_path_and_route() -> None:
    base = key()
    next_turn = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "x"}]}
    others = [
        key(body=next_turn),
        key(body={**BODY, "model": "gpt-4o-mini"}),
        key(path="/v1/responses"),
        key(route="other"),
    ]
    assert base is not None
    assert len({base, *others}) == 5


def test_ignore_fields_are_top_level_only_and_configurable() -> None:
    nested = {**BODY, "metadata": {"stream": 1}}
    assert key(body=nested) != key(body={**BODY, "metadata": {"stream": 2}})
    a = fingerprint("r", "/p", json.dumps({"a": 1, "seed": 1}).encode(), ["seed"])
    b = fingerprint("r", "/p", json.dumps({"a": 1, "seed": 2}).encode(), ["seed"])
    assert a is not None and a == b


@pytest.mark.parametrize("body", [b"", b"not json", b"{", b"\xff\xfe", b"data=1&b=2"])
def test_no_json_body_means_no_key(body: bytes) -> None:
    assert key(body=body) is None


def test_fingerprinting_can_be_switched_off() -> None:
    assert key(use_fingerprint=False) is None


def test_json_that_is_not_an_object_still_fingerprints() -> None:
    assert key(body=[1, 2]) is not None
    assert key(body=[1, 2]) != key(body=[2, 1])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.text(max_size=6), JSON, max_size=5), volatile=JSON)
def test_fingerprint_is_a_function_of_the_parsed_body_alone(
    body: dict[str, Any], volatile: Any
) -> None:
    plain = json.dumps(body).encode()
    shuffled = json.dumps(dict(reversed(list(body.items()))), indent=2).encode()
    escaped = json.dumps({**body, "stream": volatile}, ensure_ascii=True).encode()
    prints = {fingerprint("r", "/p", raw, IGNORE) for raw in (plain, shuffled, escaped)}
    without = {k: v for k, v in body.items() if k not in IGNORE}
    assert prints == {fingerprint("r", "/p", json.dumps(without).encode(), IGNORE)}
    assert None not in prints


# Text with every kind of character JSON escapes or keeps: controls, quotes, non-ASCII,
# astral characters, and lone surrogates (st.text() would never generate one).
TEXT = st.lists(
    st.characters()
    | st.characters(max_codepoint=0x1F)
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, blacklist_categories=()),
    max_size=8,
).map("".join)
EXACT = st.recursive(  # every JSON value but floats, integers of any size included
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62) | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(TEXT, EXACT, max_size=5))
def test_fingerprint_keeps_the_json_modules_canonical_form(body: dict[str, Any]) -> None:
    # orjson writes the canonical form now: for every body without floats its bytes are the
    # json module's, so a fingerprint is the one an earlier streamfence computed (replicas
    # of two versions on one Redis still recognise the same turn).
    raw = json.dumps(body).encode()
    assert fingerprint("r", "/p", raw, IGNORE) == json_module_fingerprint("r", "/p", raw, IGNORE)


@pytest.mark.parametrize(
    "values",
    [
        # orjson would write NaN and the infinities as null.
        ["NaN", "Infinity", "-Infinity", "null"],
        ["1e400", "-1e400", "null"],  # literals that parse to an infinity
        # Integers past 64 bits are exact: never rounded to the same float.
        ["18446744073709551616", "18446744073709551617", "1.8446744073709552e19"],
        ["-9223372036854775809", "-9223372036854775808"],
        ["0.1", "0.10000000000000002", "1e-07", "1e-7000", "0"],
    ],
)
def test_distinct_numbers_give_distinct_fingerprints(values: list[str]) -> None:
    prints = [fingerprint("r", "/p", b'{"a":%s}' % v.encode(), IGNORE) for v in values]
    assert None not in prints
    assert len(set(prints)) == len(values)


def test_one_number_written_two_ways_gives_one_fingerprint() -> None:
    pairs = [("1e2", "100.0"), ("1E-7", "0.0000001"), ("2.50", "2.5"), ("1e400", "Infinity")]
    for a, b in pairs:
        assert fingerprint("r", "/p", b"[%s]" % a.encode(), IGNORE) == fingerprint(
            "r", "/p", b"[%s]" % b.encode(), IGNORE
        )


# --- credential scoping -------------------------------------------------------------------

CREDENTIALS = [
    ("authorization", b"Bearer sk-AAAA"),
    ("x-api-key", b"sk-ant-AAAA"),
    ("api-key", b"azure-AAAA"),
    ("x-goog-api-key", b"goog-AAAA"),
]


@pytest.mark.parametrize(("name", "secret"), CREDENTIALS)
def test_same_turn_under_different_credentials_gives_different_keys(
    name: str, secret: bytes
) -> None:
    other = secret.replace(b"AAAA", b"BBBB")
    for extra in ([(HEADER, b"turn-1")], []):
        mine = key([(name.encode(), secret), *extra])
        theirs = key([(name.encode(), other), *extra])
        anonymous = key(list(extra))
        assert mine is not None and theirs is not None and anonymous is not None
        assert len({mine, theirs, anonymous}) == 3
        assert key([(name.encode(), secret), *extra]) == mine  # stable


def test_query_key_scopes_like_a_header() -> None:
    turn = [(HEADER, b"t")]
    a = key(turn, query="alt=sse&key=goog-AAAA")
    b = key(turn, query="key=goog-BBBB&alt=sse")
    assert len({a, b, key(turn, query="alt=sse")}) == 3
    assert key(turn, query="key=goog-AAAA") == a  # other parameters do not matter
    assert key(turn, query="apikey=goog-AAAA") == key(turn)  # only `key` is a credential


def test_credential_header_and_value_both_count() -> None:
    assert credential_scope([(b"authorization", b"k")]) != credential_scope([(b"x-api-key", b"k")])
    assert credential_scope([]) == "anonymous"
    assert credential_scope([(b"content-type", b"application/json")]) == "anonymous"
    both = [(b"authorization", b"a"), (b"x-api-key", b"b")]
    assert credential_scope(both) == credential_scope(both[::-1])


@pytest.mark.parametrize(("name", "secret"), CREDENTIALS)
def test_raw_credential_never_appears_in_the_turn_key(name: str, secret: bytes) -> None:
    for extra in ([(HEADER, b"turn-1")], []):
        turn = key([(name.encode(), secret), *extra])
        assert turn is not None
        for text in (turn.key, turn.short, repr(turn), str(turn)):
            assert "AAAA" not in text and secret.decode() not in text
    turn = key([(HEADER, b"t")], query="key=goog-AAAA")
    assert turn is not None and "AAAA" not in repr(turn)
    assert "AAAA" not in credential_scope([], "key=goog-AAAA")


def test_key_is_hex_sha256_and_short_is_its_prefix() -> None:
    turn = key([(HEADER, b"t"), (b"authorization", b"Bearer x")])
    assert turn is not None
    assert len(turn.key) == 64 and int(turn.key, 16) >= 0
    assert turn.short == turn.key[:16]
    assert turn.key.startswith(turn.short)


def test_header_and_fingerprint_keys_never_collide() -> None:
    # A turn id equal to a body's fingerprint must not land on the same key.
    fp = fingerprint("default", "/v1/chat/completions", json.dumps(BODY).encode(), IGNORE)
    assert fp is not None
    assert key([(HEADER, fp.encode())]) != key()


# --- bodies that once crashed the fingerprint ---------------------------------------------


def test_lone_surrogate_escape_is_json_and_fingerprints() -> None:
    # A truncated emoji: valid JSON, but the string is not encodable as UTF-8.
    a = key(body=b'{"messages":[{"content":"cut \\ud83d"}]}')
    b = key(body=b'{"messages":[{"content":"cut \\ud83e"}]}')
    assert a is not None and b is not None and a != b
    streamed = key(body=b'{"messages":[{"content":"cut \\ud83d"}], "stream":true}')
    assert streamed is not None and streamed.key == a.key and streamed.streaming


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_json_nested_too_deep_to_parse_gets_no_fingerprint(depth: int) -> None:
    assert key(body=b"[" * depth + b"]" * depth) is None
    assert key(body=b'{"a":' * depth + b"1" + b"}" * depth) is None
    # An explicit turn id still works for such a body.
    assert key([(HEADER, b"t")], b"[" * depth + b"]" * depth) is not None


def test_moderately_nested_json_still_fingerprints() -> None:
    assert key(body=b"[" * 100 + b"]" * 100) is not None


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=64)
    | st.builds(lambda v: json.dumps(v).encode(), JSON)
    | st.builds(
        lambda s: json.dumps({"m": s}).encode(),
        # Lone surrogates too (JSON escapes them); st.text() would never generate one.
        st.lists(
            st.characters()
            | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, blacklist_categories=()),
            max_size=8,
        ).map("".join),
    ),
    headers=st.lists(
        st.tuples(
            st.sampled_from([HEADER, b"authorization", b"x-api-key", b"other"]),
            st.binary(max_size=300),
        ),
        max_size=4,
    ),
    query=st.text(max_size=20),
)
def test_resolve_returns_a_key_or_none_or_raises_bad_request(
    body: bytes, headers: list[tuple[bytes, bytes]], query: str
) -> None:
    try:
        turn = key(headers, body, query=query)
    except BadRequest:
        assert any(name == HEADER for name, _ in headers)
        return
    if turn is not None:
        assert len(turn.key) == 64


# --- what the mutation run asked for --------------------------------------------------------


def test_keys_are_the_same_in_every_version_of_the_proxy() -> None:
    # Processes sharing a Redis registry key turns alike; during a rolling upgrade they run
    # two versions, so a key's recipe is part of the contract: these values may not change.
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    fp = "54c10bb6c26a75a41d057d239d11e504a417d690cce1115f5619cfefe520be8f"
    assert fingerprint("default", "/v1/chat/completions", body, ()) == fp
    explicit = key([(HEADER, b"t"), (b"authorization", b"Bearer k")], b"", path="/v1/x")
    assert explicit == TurnKey(
        "a6c4c0d0e3b7e3dafe4a086b9acf6559f71d03cfac783fe7000e11131e59d45d",
        "header",
        "1b4698284913b0d4fe621f9d3e6a883d6cb74c674e2042f19a72de3bd1088425",
        False,
    )


def test_route_and_path_are_never_joined_ambiguously() -> None:
    body = json.dumps(BODY).encode()
    assert fingerprint("a", "/b/c", body, IGNORE) != fingerprint("a/b", "/c", body, IGNORE)


def test_a_turn_id_may_hold_spaces_and_printable_characters() -> None:
    assert explicit_turn_id([(HEADER, b"turn 1 ~!")], HEADER) == b"turn 1 ~!"


@pytest.mark.parametrize(
    ("body", "path", "streaming"),
    [
        ({**BODY, "stream": True}, "/v1/chat/completions", True),
        ({**BODY, "stream": False}, "/v1/chat/completions", False),
        ({"model": "m"}, "/v1/chat/completions", False),
        ({"contents": []}, "/v1beta/models/g:streamGenerateContent", True),
        ({"contents": []}, "/v1beta/models/g:generateContent", False),
        (b"", "/v1beta/models/g:streamGenerateContent", True),  # bodiless: from the path
        (b"", "/v1/events", False),
    ],
)
def test_the_streaming_mode_comes_from_the_body_or_geminis_path(
    body: Any, path: str, streaming: bool
) -> None:
    got = key([(HEADER, b"t")], body, path=path)
    assert got is not None and got.streaming is streaming


def test_identical_requests_under_a_turn_id_are_identical_whatever_their_body() -> None:
    turn = [(HEADER, b"t")]
    # JSON: the canonical body decides, volatile fields and key order aside.
    a = key(turn, {"messages": ["x"], "model": "m", "stream": True})
    b = key(turn, {"model": "m", "messages": ["x"], "stream_options": {}, "stream": True})
    assert a is not None and b is not None and a.body_fingerprint == b.body_fingerprint
    # Not JSON: its bytes decide; bodiless: its query, less a Gemini key.
    raw = [key(turn, b"not json") for _ in range(2)] + [key(turn, b"not json either")]
    assert raw[0] == raw[1] and raw[0] is not None and raw[0].body_fingerprint is not None
    assert raw[2] is not None and raw[2].body_fingerprint != raw[0].body_fingerprint
    get = [key(turn, b"", query=q) for q in ("a=1&key=s1", "key=s2&a=1", "a=2")]
    assert all(g is not None for g in get)
    identities = [g.body_fingerprint for g in get if g is not None]
    assert identities[0] == identities[1] != identities[2]
    assert raw[0].body_fingerprint not in identities


def test_a_turn_id_in_the_query_is_used_only_without_the_header() -> None:
    def resolved(headers: list[tuple[bytes, bytes]], query_id: bytes | None) -> TurnKey | None:
        return resolve(
            headers,
            "",
            b"",
            header_name=HEADER,
            route="default",
            path="/v1/events",
            use_fingerprint=True,
            ignore_fields=IGNORE,
            query_turn_id=query_id,
        )

    from_query, from_header = resolved([], b"tab-1"), resolved([(HEADER, b"tab-1")], None)
    assert from_query is not None and from_query == from_header
    both = resolved([(HEADER, b"tab-1")], b"tab-2")
    assert both == from_header
    with pytest.raises(BadRequest):
        resolved([], b"")


@pytest.mark.parametrize(
    ("query", "name", "rest", "found"),
    [
        ("topic=x&streamfence_turn=tab-1", "streamfence_turn", "topic=x", b"tab-1"),
        ("streamfence_turn=a%20b+c&x=1", "streamfence_turn", "x=1", b"a b c"),
        ("topic=x", "streamfence_turn", "topic=x", None),
        ("my_streamfence_turn=1", "streamfence_turn", "my_streamfence_turn=1", None),
        ("streamfence_turn=1", "", "streamfence_turn=1", None),  # no name configured
    ],
)
def test_the_turn_id_query_parameter_is_taken_out_of_the_query(
    query: str, name: str, rest: str, found: bytes | None
) -> None:
    assert split_query_turn(query, name) == (rest, found)
