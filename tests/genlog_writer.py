"""A generation-log writer in a process of its own, for tests that kill it.

`python -m tests.genlog_writer URL KEY TOKEN`: opens the log, writes its start and one
batch, prints "ready", then keeps the log alive (heartbeats) until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

from proxy.registry.genlog.log import GenerationLog
from proxy.registry.redisio import connect


async def main(url: str, key: str, token: int) -> None:
    log = GenerationLog(connect(url))
    writer = await log.open(key, token, body_hash="b", streaming=True)
    writer.started(200, [("content-type", "text/event-stream")])
    writer.append([b"data: 0\n\n"])
    await writer.flushed()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
