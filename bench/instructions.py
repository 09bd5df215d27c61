"""The proxy's own CPU per request and per relayed event, counted in instructions:
`python -m bench.instructions`.

Seconds of CPU drift with the host: the same code measured 30 % apart from one hour to the
next on this project's VMs, so an A/B of a few percent drowns. valgrind's callgrind counts
the instructions a process executes, which depend on the code and its inputs, hardly on
the host: run after run, within 1 % for requests and 5 % for events (whose timers and
reads still follow the clock), with the other core loaded or not. streamfence runs under
callgrind with its instrumentation switched on only while the measured requests run, behind
the bench's scripted upstream; the load client sends them one after the other in four
shapes:

    keepalive   one-token streams on one keep-alive connection (B1's shape)
    fresh       the same, each on a connection of its own
    supersede   pairs: a long stream, then once its first event is in, a newer request of
                the same turn on another connection, which fences it (B5's shape)
    stream      a stream of events 20 ms apart (B3's pace), each read and relayed on its
                own; then one twice as long: the difference is the cost of an event

and, for scale, `floor`: the same keep-alive requests against a bare ASGI app on the same
uvicorn settings (uvloop, httptools, the accept loop) that streams three events: what
serving a request costs before the proxy does anything.

Instructions are not seconds: a cache miss or a system call's time in the kernel is not
in them (callgrind counts user space only). Use them to compare code, not hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import client
from bench.loop import run_fast
from bench.run import ROOT, free_port, start_upstream, wait_port

SHAPES = ("keepalive", "fresh", "supersede", "stream")

# The floor's app, run in its own process: the request read, three events and the end.
FLOOR_APP = """
import socket, sys
import uvicorn

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(3):
        await send({"type": "http.response.body", "body": b"data: x\\n\\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})

sock = socket.socket()
sock.bind(("127.0.0.1", int(sys.argv[1])))
uvicorn.Server(uvicorn.Config(
    app, loop="proxy.server.listen:Loop", http="httptools", lifespan="on", access_log=False,
    log_config=None, server_header=False, date_header=False, proxy_headers=False,
)).run(sockets=[sock])
"""


# The load client's own scenarios (bench/client.py), one request at a time.


async def keepalive(port: int, tag: str, n: int) -> None:
    await client.ttft({"port": port, "n": n, "tag": tag})


async def fresh(port: int, tag: str, n: int) -> None:
    slots = asyncio.Semaphore(1)
    for i in range(n):
        await client.one_stream(port, 1, 0, f"{tag}-{i}", slots)


async def supersede(port: int, tag: str, n: int) -> None:
    slots = asyncio.Semaphore(2)
    for i in range(n // 2):
        _, _, fenced = await client._supersede(port, f"{tag}-{i}", slots, close_only=False)
        if not fenced:
            raise RuntimeError(f"supersede {i} did not fence its old stream")


async def stream(port: int, tag: str, n: int) -> None:
    """One stream of `n` events 20 ms apart: each is read and relayed on its own, even as
    slowly as valgrind runs the proxy."""
    result = await client.one_stream(port, n, 20, f"{tag}-stream", asyncio.Semaphore(1))
    if result.events != n + 2:
        raise RuntimeError(f"the stream ended short: {result}")


DRIVERS: dict[str, Callable[[int, str, int], Awaitable[None]]] = {
    "keepalive": keepalive,
    "fresh": fresh,
    "supersede": supersede,
    "stream": stream,
}


def measure(
    shape: str, phases: list[int], command: list[str], port: int, workdir: Path
) -> list[int]:
    """Instructions of the process `command` starts (listening on `port`) in each phase: a
    phase is `n` requests of `shape`, counted on their own. Unmeasured ones warm it up first."""
    out = workdir / f"{shape}.callgrind"
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",  # switched on around the measured requests only
            f"--callgrind-out-file={out}",
            *command,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(workdir / f"{shape}.log").open("w"),
        env={**os.environ, "STREAMFENCE_SERVER_LOG_FORMAT": "json"},
    )
    try:
        wait_port(port, proc, timeout=300)  # under valgrind, startup takes a while

        def control(*args: str) -> None:
            subprocess.run(
                ["callgrind_control", *args, str(proc.pid)], check=True, capture_output=True
            )

        async def run() -> None:
            driver = DRIVERS[shape]
            await driver(port, "warm", max(2, phases[0] // 4))
            for i, n in enumerate(phases):
                control("-i", "on")
                await driver(port, f"measured{i}", n)
                control("-i", "off")
                control("--dump")  # one file a phase: .1, .2, ...

        run_fast(run())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [_total(Path(f"{out}.{i + 1}")) for i in range(len(phases))]


def _total(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def run(shapes: list[str], n: int, events: int, floor: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="streamfence-instructions-"))
    log = (workdir / "upstream.log").open("w")
    upstream, up_port = start_upstream(log)
    results: dict[str, Any] = {"requests": n, "events": events, "per_request": {}}
    try:
        for shape in shapes:
            port = free_port()
            command = [sys.executable, "-m", "proxy", "--upstream", f"http://127.0.0.1:{up_port}"]
            command += ["--port", str(port)]
            if shape == "stream":  # a stream of `events`, then one of twice as many
                one, two = measure(shape, [events, 2 * events], command, port, workdir)
                results["per_event"] = (two - one) // events
            else:
                (total,) = measure(shape, [n], command, port, workdir)
                results["per_request"][shape] = total // n
        if floor:
            script = workdir / "floor.py"
            script.write_text(FLOOR_APP)
            port = free_port()
            command = [sys.executable, str(script), str(port)]
            (total,) = measure("keepalive", [n], command, port, workdir)
            results["per_request"]["floor"] = total // n
    finally:
        upstream.terminate()
        upstream.wait(10)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.instructions", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=200, help="measured requests per shape")
    p.add_argument("--events", type=int, default=100, help="events of the shorter stream")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--no-floor", action="store_true", help="skip the bare uvicorn app")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    results = run(args.shapes, args.requests, args.events, not args.no_floor)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"instructions per request, {args.requests} requests each (valgrind callgrind)\n")
    print("| shape | instructions |\n|---|---|")
    for shape, count in results["per_request"].items():
        print(f"| {shape} | {count:,} |")
    if "per_event" in results:
        print(f"\nper relayed event (a stream read event by event): {results['per_event']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
