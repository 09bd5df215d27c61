"""Content codings: what the proxy may let an upstream send.

The relay has to read an event stream's events to fence them, so it decodes an encoded one
(httpx's decoders) and sends it on plain. It cannot know before the response whether the
answer will be an event stream, so every request offers the upstream only the codings the
proxy itself can decode. Agents advertise `zstd` and `br`; with `zstandard` and `brotli`
installed (dependencies) those are kept, so their offers still count. Other bodies are not
decoded: they pass byte for byte, in whichever of the offered codings the upstream chose.
Pure and I/O-free.
"""

from __future__ import annotations

import importlib.util
import zlib


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in modules)


# The codings httpx decodes here (httpx._decoders picks up the same optional modules).
DECODABLE: frozenset[bytes] = frozenset(
    {b"gzip", b"deflate"}
    | ({b"br"} if _installed("brotli", "brotlicffi") else set())
    | ({b"zstd"} if _installed("zstandard") else set())
)


def offer(accept_encoding: bytes, decodable: frozenset[bytes] = DECODABLE) -> bytes:
    """The client's Accept-Encoding with every coding the proxy cannot decode left out.

    `*` stands for the decodable codings the client did not name. When nothing is left,
    `identity`: an absent header would mean that any coding is acceptable (RFC 9110
    section 12.5.3)."""
    kept: list[bytes] = []
    named: set[bytes] = set()
    star: bytes | None = None
    for entry in accept_encoding.split(b","):
        entry = entry.strip()
        coding, _, params = entry.partition(b";")
        coding = coding.strip().lower()
        if not coding:
            continue
        named.add(coding)
        if coding in decodable or coding == b"identity":
            kept.append(entry)
        elif coding == b"*" and not _refused(params):
            star = params.strip()
    if star is not None:
        suffix = b";" + star if star else b""
        kept += [c + suffix for c in sorted(decodable - named)]
    return b", ".join(kept) if kept else b"identity"


def _refused(params: bytes) -> bool:
    """True for a `q=0` parameter: "not acceptable"."""
    for param in params.split(b";"):
        key, _, value = param.partition(b"=")
        if key.strip().lower() == b"q":
            try:
                return float(value.strip() or b"1") == 0
            except ValueError:
                return False
    return False


def decoded(body: bytes, coding: bytes, limit: int) -> bytes | None:
    """`body` decoded from its Content-Encoding `coding`, if it decodes to at most `limit`
    bytes (a small body may inflate to gigabytes); None when it does not, or is in a coding
    this process cannot decode (or in more than one: nobody sends those)."""
    coding = coding.strip().lower()
    try:
        if coding in (b"", b"identity"):
            out = body
        elif coding in (b"gzip", b"x-gzip", b"deflate"):
            # gzip, or deflate's zlib wrapper (47: either header); deflate sent raw (-15)
            # by servers that misread the RFC.
            wbits = 47 if coding != b"deflate" or body[:1] == b"x" else -15
            out = zlib.decompressobj(wbits).decompress(body, limit + 1)
        elif coding == b"br" and b"br" in DECODABLE:
            import brotli  # type: ignore[import-untyped]

            out = brotli.Decompressor().process(body, output_buffer_limit=limit + 1)
        elif coding == b"zstd" and b"zstd" in DECODABLE:
            import zstandard

            out = zstandard.ZstdDecompressor().stream_reader(body).read(limit + 1)
        else:
            return None
    except Exception:  # noqa: BLE001 - each library's own error for a corrupt body: unknown
        return None
    return out if len(out) <= limit else None
