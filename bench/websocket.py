"""B6, WebSocket mode: what the relay costs per message against a direct WebSocket connection
(in one run, alternating targets), and the memory of idle sockets held through the proxy.

    python -m bench.websocket [--smoke] [--out FILE]

Processes: a Responses-mode WebSocket upstream (this module, `--serve`), streamfence as a
user runs it (bench.run.start_streamfence: uvicorn, uvloop, httptools), and this process as
the client. Every message goes through the fence (/v1/responses, one response.create per
response); both hops negotiate permessage-deflate, as the openai SDK and websockets do.

    stream   responses of N delta events: wall time and proxy CPU per message relayed
    rtt      response.create -> response.created round trips (median, p99)
    idle     K sockets opened through the proxy and left idle: proxy RSS per socket
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from bench.run import cpu_seconds, start_streamfence, status_kb

FULL = {"responses": 200, "events": 100, "rtt": 500, "idle": 1000, "rounds": 3}
SMOKE = {"responses": 10, "events": 20, "rtt": 20, "idle": 50, "rounds": 1}
DELTA = "x" * 40  # a token's worth of text


async def upstream_handler(ws: ServerConnection) -> None:
    async for raw in ws:
        request = json.loads(raw)
        n = int(request.get("metadata", {}).get("events", "1"))
        rid = f"resp_{time.monotonic_ns()}"
        await ws.send(
            json.dumps({"type": "response.created", "sequence_number": 0, "response": {"id": rid}})
        )
        for i in range(n):
            event = {
                "type": "response.output_text.delta",
                "sequence_number": i + 1,
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": DELTA,
            }
            await ws.send(json.dumps(event))
        done = {"type": "response.completed", "sequence_number": n + 1, "response": {"id": rid}}
        await ws.send(json.dumps(done))


async def serve_upstream() -> None:
    async with serve(upstream_handler, "127.0.0.1", 0, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"ready {port}", flush=True)
        await asyncio.Future()


def create(n: int, i: int) -> str:
    # Each response its own input: a distinct turn, so none supersedes another.
    return json.dumps(
        {"type": "response.create", "model": "m", "input": f"q{i}", "metadata": {"events": str(n)}}
    )


async def one(ws: ClientConnection, n: int, i: int) -> int:
    await ws.send(create(n, i))
    count = 0
    while True:
        count += 1
        if '"response.completed"' in str(await ws.recv()):
            return count


async def stream(port: int, spec: dict[str, Any]) -> tuple[float, int]:
    """Wall time of the responses, and the messages received (all of them, or the run
    measured nothing)."""
    received = 0
    async with connect(f"ws://127.0.0.1:{port}/v1/responses", max_size=None) as ws:
        started = time.perf_counter()
        for i in range(spec["responses"]):
            received += await one(ws, spec["events"], i)
        return time.perf_counter() - started, received


async def rtt(port: int, spec: dict[str, Any]) -> list[float]:
    out = []
    async with connect(f"ws://127.0.0.1:{port}/v1/responses", max_size=None) as ws:
        for i in range(spec["rtt"]):
            started = time.perf_counter()
            await ws.send(create(0, i))
            await ws.recv()  # response.created
            out.append(time.perf_counter() - started)
            await ws.recv()  # response.completed
    return out


async def idle(port: int, pid: int, k: int) -> dict[str, float]:
    before = status_kb(pid, "VmRSS")
    sockets = [await connect(f"ws://127.0.0.1:{port}/v1/responses") for _ in range(k)]
    await asyncio.sleep(1.0)  # let the proxy settle (allocator, buffers)
    after = status_kb(pid, "VmRSS")
    for ws in sockets:
        await ws.close()
    return {
        "sockets": k,
        "rss_before_mb": before / 1024,
        "rss_after_mb": after / 1024,
        "kib_per_socket": (after - before) / k,
    }


async def measure(
    upstream_port: int, proxy_port: int, proxy_pid: int, spec: dict[str, Any]
) -> dict[str, Any]:
    targets = {"direct": upstream_port, "streamfence": proxy_port}
    walls: dict[str, list[float]] = {t: [] for t in targets}
    received: dict[str, int] = {t: 0 for t in targets}
    cpu: list[float] = []
    rtts: dict[str, list[float]] = {t: [] for t in targets}
    for r in range(spec["rounds"]):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for name in order:
            before = cpu_seconds([proxy_pid])
            wall, count = await stream(targets[name], spec)
            walls[name].append(wall)
            received[name] += count
            if name == "streamfence":
                cpu.append(cpu_seconds([proxy_pid]) - before)
            rtts[name] += await rtt(targets[name], spec)
    messages = spec["responses"] * (spec["events"] + 2)
    wall = {t: statistics.median(v) for t, v in walls.items()}
    per_msg = {t: wall[t] / messages * 1e6 for t in targets}
    return {
        "messages_per_run": messages,
        "messages_received": received,  # per target, over all rounds
        "us_per_message": per_msg,
        "overhead_us_per_message": per_msg["streamfence"] - per_msg["direct"],
        "ratio": wall["streamfence"] / wall["direct"],
        "proxy_cpu_us_per_message": statistics.median(cpu) / messages * 1e6,
        "rtt_ms": {
            t: {"p50": statistics.median(v) * 1e3, "p99": sorted(v)[int(len(v) * 0.99) - 1] * 1e3}
            for t, v in rtts.items()
        },
        "idle": await idle(proxy_port, proxy_pid, spec["idle"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.websocket")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve_upstream())
        return 0
    import subprocess  # noqa: PLC0415

    spec = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        log = (Path(tmp) / "bench.log").open("w")
        up = subprocess.Popen(
            [sys.executable, "-m", "bench.websocket", "--serve"],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert up.stdout is not None
            line = up.stdout.readline()
            if not line.startswith("ready "):
                raise RuntimeError("the WebSocket bench upstream did not start")
            target = start_streamfence(int(line.split()[1]), log)
            try:
                result = asyncio.run(
                    measure(int(line.split()[1]), target.port, target.pids[0], spec)
                )
            finally:
                target.stop()
        finally:
            up.terminate()
            up.wait(10)
    result["spec"] = spec
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
