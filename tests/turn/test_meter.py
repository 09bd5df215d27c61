"""The meter reads a generation's usage once its answer is over, from its buffer: the last
events of a stream (kept across the drops of a buffer over its cap), a whole body decoded
from its Content-Encoding (bounded), never anything per event."""

from __future__ import annotations

import gzip
import json
import zlib

import brotli
import pytest
import zstandard

from proxy.turn.buffer import Budget, EventBuffer
from proxy.turn.meter import Meter
from proxy.wire import usage
from proxy.wire.codings import decoded
from proxy.wire.usage import Usage

CHAT_USAGE = {"prompt_tokens": 9, "completion_tokens": 4}
WHOLE = json.dumps({"object": "chat.completion", "model": "m-1", "usage": CHAT_USAGE}).encode()


def _chunk(n: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % n


def _usage_chunk() -> bytes:
    return b"data: " + json.dumps({"choices": [], "model": "m-1", "usage": CHAT_USAGE}).encode()


def _buffer(cap: int = 1 << 20) -> EventBuffer:
    return EventBuffer(cap, Budget(1 << 30))


def test_a_stream_s_final_usage_is_read_from_its_last_events() -> None:
    buffer = _buffer()
    meter = Meter("openai-chat", buffer)
    buffer.add([_chunk(i) for i in range(50)])
    buffer.add([_usage_chunk() + b"\n\n", b"data: [DONE]\n\n"])
    assert meter.close(True, []) == Usage(input=9, output=4, model="m-1")


def test_the_last_events_are_kept_when_the_buffer_drops_them() -> None:
    # Over its cap, the buffer drops what every client has written: the usage chunk and
    # [DONE] were written and dropped before the answer ended.
    buffer = _buffer()
    meter = Meter("openai-chat", buffer)
    buffer.add([_chunk(i) for i in range(10)] + [_usage_chunk() + b"\n\n"])
    meter.dropping()
    buffer.drop_through(buffer.last_id)
    buffer.add([b"data: [DONE]\n\n"])
    meter.dropping()
    buffer.drop_through(buffer.last_id)
    assert buffer.events == []
    assert meter.close(True, []) == Usage(input=9, output=4, model="m-1")


def test_events_after_a_drop_are_not_counted_twice() -> None:
    # Anthropic's two reports: message_delta carries the output; the last one wins.
    def delta(n: int) -> bytes:
        data = {"type": "message_delta", "usage": {"output_tokens": n}}
        return b"event: message_delta\ndata: " + json.dumps(data).encode() + b"\n\n"

    buffer = _buffer()
    meter = Meter("anthropic", buffer)
    buffer.add([delta(1), delta(2)])
    meter.dropping()
    buffer.drop_through(1)  # delta(2) is still in the buffer, and in the kept tail
    buffer.add([delta(3)])
    assert meter.close(True, []) == Usage(output=3)


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        (b"", lambda b: b),
        (b"gzip", gzip.compress),
        (b"deflate", zlib.compress),
        (b"br", brotli.compress),
        (b"zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_a_whole_body_is_read_in_its_content_encoding(coding: bytes, encode: object) -> None:
    body = encode(WHOLE)  # type: ignore[operator]
    buffer = _buffer()
    meter = Meter("openai-chat", buffer)
    buffer.add([body[:7], body[7:]])  # as it came, in chunks
    headers = [(b"Content-Encoding", coding)] if coding else []
    assert meter.close(False, headers) == Usage(input=9, output=4, model="m-1")


def test_a_body_the_buffer_dropped_or_too_large_or_a_bomb_is_unknown() -> None:
    dropped = _buffer()
    meter = Meter("openai-chat", dropped)
    dropped.add([WHOLE[:10], WHOLE[10:]])
    dropped.drop_through(1)
    assert meter.close(False, []) is None
    huge = _buffer(1 << 30)
    huge.add([WHOLE + b" " * usage.MAX_BODY_BYTES])
    assert Meter("openai-chat", huge).close(False, []) is None
    bomb = gzip.compress(b"{" + b" " * (usage.MAX_BODY_BYTES + 1))  # 4 KiB, inflating to 4 MiB
    assert decoded(bomb, b"gzip", usage.MAX_BODY_BYTES) is None
    assert decoded(b"not gzip", b"gzip", 100) is None
    assert decoded(WHOLE, b"compress", 1000) is None  # a coding nobody decodes here


def test_anthropic_s_opening_report_is_kept_when_the_buffer_drops_it() -> None:
    start = {"type": "message_start", "message": {"model": "c-1", "usage": {"input_tokens": 7}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 3}}
    buffer = _buffer()
    meter = Meter("anthropic", buffer)
    buffer.add([b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"])
    buffer.add([b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'] * 5)
    meter.dropping()  # nobody asked what it cost so far: the drop must read it
    buffer.drop_through(buffer.last_id)
    buffer.add([b"event: message_delta\ndata: " + json.dumps(delta).encode() + b"\n\n"])
    assert meter.close(True, []) == Usage(input=7, output=3, model="c-1")
    so_far = _buffer()
    so_far.add([b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"])
    assert Meter("anthropic", so_far).usage == Usage(input=7, model="c-1")  # the status page
