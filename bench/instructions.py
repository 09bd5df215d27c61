"""The proxy's own CPU per request, counted in instructions: `python -m bench.instructions`.

Seconds of CPU drift with the host: the same code measured 30 % apart from one hour to the
next on this project's VMs, so an A/B of a few percent drowns. valgrind's callgrind counts
the instructions a process executes, which depend on the code and its inputs only (the same
count to 0.1 % run after run, with the other core loaded or not). streamfence runs under
callgrind with its instrumentation switched on only while the measured requests run, behind
the bench's scripted upstream; the load client sends them one after the other in three
shapes:

    keepalive   one-token streams on one keep-alive connection (B1's shape)
    fresh       the same, each on a connection of its own
    supersede   pairs: a long stream, then once its first event is in, a newer request of
                the same turn on another connection, which fences it (B5's shape)

and, for scale, `floor`: the same keep-alive requests against a bare ASGI app on the same
uvicorn settings (uvloop, httptools, the accept loop) that streams three events: what
serving a request costs before the proxy does anything.

Instructions are not seconds: a cache miss or a system call's time in the kernel is not
in them (callgrind counts user space only). Use them to compare code, not hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
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

SHAPES = ("keepalive", "fresh", "supersede")

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
    app, loop="proxy.listen:Loop", http="httptools", lifespan="on", access_log=False,
    log_config=None, server_header=False, date_header=False, proxy_headers=False,
)).run(sockets=[sock])
"""


async def keepalive(port: int, tag: str, n: int) -> None:
    conn = await client.connect(port)
    for i in range(n):
        await conn.request(1, 0, f"{tag}-{i}")
    conn.close()


async def fresh(port: int, tag: str, n: int) -> None:
    for i in range(n):
        conn = await client.connect(port)
        await conn.request(1, 0, f"{tag}-{i}")
        conn.close()


async def supersede(port: int, tag: str, n: int) -> None:
    for i in range(n // 2):
        turn = f"{tag}-turn-{i}"
        old = await client.connect(port)
        pending = old.request(10_000, 20, f"{tag}-old-{i}", turn)
        assert old.first is not None
        await asyncio.wait([old.first, pending], return_when=asyncio.FIRST_COMPLETED)
        new = await client.connect(port)
        result = await new.request(1, 0, f"{tag}-new-{i}", turn)
        new.close()
        ended = await asyncio.wait_for(pending, 10)
        old.close()
        if result.status != 200 or ended.events >= 10_000:
            raise RuntimeError(f"supersede {i} did not fence: {result}, {ended}")


DRIVERS: dict[str, Callable[[int, str, int], Awaitable[None]]] = {
    "keepalive": keepalive,
    "fresh": fresh,
    "supersede": supersede,
}


def measure(shape: str, n: int, command: list[str], port: int, workdir: Path) -> int:
    """Instructions of the process `command` starts (listening on `port`) while it serves
    `n` requests of `shape`, after as many unmeasured ones to warm it up."""
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
            await driver(port, "warm", max(2, n // 4))
            control("-i", "on")
            await driver(port, "measured", n)
            control("-i", "off")
            control("--dump")

        run_fast(run())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return _total(workdir, out)


def _total(workdir: Path, out: Path) -> int:
    """The instructions in callgrind's output files (one per dump: at exit, and more if
    the process forked), counted once each."""
    total = 0
    for name in glob.glob(f"{out}*"):
        for line in Path(name).read_text().splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total


def run(shapes: list[str], n: int, floor: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="streamfence-instructions-"))
    log = (workdir / "upstream.log").open("w")
    upstream, up_port = start_upstream(log)
    results: dict[str, Any] = {"requests": n, "per_request": {}}
    try:
        for shape in shapes:
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "proxy",
                "--upstream",
                f"http://127.0.0.1:{up_port}",
                "--port",
                str(port),
            ]
            total = measure(shape, n, command, port, workdir)
            results["per_request"][shape] = total // n
        if floor:
            script = workdir / "floor.py"
            script.write_text(FLOOR_APP)
            port = free_port()
            total = measure("keepalive", n, [sys.executable, str(script), str(port)], port, workdir)
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
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--no-floor", action="store_true", help="skip the bare uvicorn app")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    results = run(args.shapes, args.requests, not args.no_floor)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"instructions per request, {args.requests} requests each (valgrind callgrind)\n")
    print("| shape | instructions |\n|---|---|")
    for shape, count in results["per_request"].items():
        print(f"| {shape} | {count:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
