"""The benchmark runner: starts every process on loopback, runs B1-B5 interleaved, reports.

    python -m bench [--smoke] [--rounds N] [--no-nginx] [--out FILE]

Processes: the scripted upstream (bench.upstream), streamfence as a user runs it
(`python -m proxy --upstream URL --port P`: uvicorn, uvloop, httptools), nginx with
`proxy_buffering off` when a binary exists, and one load client (bench.client) per
measurement. Each scenario runs its rounds target by target in a rotating order, so a
noisy neighbour on a shared machine hits all targets alike; results are reported against
direct from the same run. CPU seconds come from /proc/PID/stat (the client's from wait4),
peak RSS from VmHWM in /proc/PID/status, reset before each measurement via clear_refs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import render, summarize

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

FULL: dict[str, dict[str, Any]] = {
    "B1": {"kind": "ttft", "n": 300},
    "B2": {"kind": "throughput", "tokens": 20_000},
    "B3": {"kind": "concurrent", "n": 200, "tokens": 100, "delay_ms": 20},
    "B4": {"kind": "concurrent", "n": 2000, "tokens": 50, "delay_ms": 50},
    "B5": {
        "kind": "fence",
        "n": 500,
        "lanes": 10,
        "interval_ms": 40,  # one supersede every 4 ms (250/s): 2 s of them
        # B3's load (200 streams, a token every 20 ms), long enough (3 s) to outlast them
        "load": {"n": 200, "tokens": 150, "delay_ms": 20},
    },
}
SMOKE: dict[str, dict[str, Any]] = {
    "B1": {"kind": "ttft", "n": 20},
    "B2": {"kind": "throughput", "tokens": 2_000},
    "B3": {"kind": "concurrent", "n": 20, "tokens": 10, "delay_ms": 5},
    "B4": {"kind": "concurrent", "n": 100, "tokens": 5, "delay_ms": 10},
    "B5": {
        "kind": "fence",
        "n": 20,
        "lanes": 4,
        "interval_ms": 5,
        "load": {"n": 20, "tokens": 40, "delay_ms": 5},
    },
}
# B2 is one short stream (tens of ms): more rounds, so its median survives a noisy neighbour.
ROUNDS = {"B1": 3, "B2": 7, "B3": 3, "B4": 2, "B5": 2}
FENCING = {"streamfence", "sf-httpx"}  # the others get B5's close-only floor

NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    upstream up {{ server 127.0.0.1:{upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port} backlog=8192;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} did not listen on {port}")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def cpu_times() -> list[int]:
    """The machine's CPU time so far, by kind (/proc/stat's `cpu` line, in ticks)."""
    with open("/proc/stat") as stat:
        return [int(v) for v in stat.readline().split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of the machine's CPU time the hypervisor gave to others meanwhile
    (`steal`, the 8th field): on a shared VM it varies run to run and every figure with it."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return delta[7] / sum(delta) if sum(delta) else 0.0


class CpuSampler:
    """The CPU seconds of some processes, read every 50 ms in a thread of the runner: how
    much of a core they used in a window of the measurement (B5: while the supersedes run,
    which is when the proxy's work peaks)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), cpu_seconds(self.pids)))
            if self._done.wait(0.05):
                return

    def stop(self) -> CpuSampler:
        self._done.set()
        self._thread.join()
        return self

    def share(self, start: float, end: float) -> float:
        """CPU seconds a second between `start` and `end` (1.0: one core, all the time)."""

        def at(t: float) -> float:  # interpolated between the samples around t
            for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
                if t0 <= t <= t1:
                    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c0
            return self.samples[0][1] if t < self.samples[0][0] else self.samples[-1][1]

        return (at(end) - at(start)) / (end - start) if end > start else math.nan


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pids: list[int]) -> None:
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS
        except OSError:
            pass


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(entry.name))
    return out


@dataclass
class Target:
    name: str
    port: int
    proc: subprocess.Popen[Any] | None = None  # None: direct, the upstream itself
    pids: list[int] = field(default_factory=list)  # whose CPU and RSS count as the proxy's
    log: Path | None = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_upstream(log: Any) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError("the bench upstream did not start")
    return proc, int(line.split()[1])


def start_streamfence(upstream: int, log: Any, name: str = "streamfence") -> Target:
    port = free_port()
    url = f"http://127.0.0.1:{upstream}"
    env = dict(os.environ)
    # streamfence as it ships (proxy/upstream/transport.py, the default; set here all the same
    # so the column means one thing); sf-httpx the same proxy on httpx's transport (httpcore + h11).
    env["STREAMFENCE_SERVER_HTTP_TRANSPORT"] = "httpx" if name == "sf-httpx" else "fast"
    own_log = Path(log.name).with_name(f"{name}.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--upstream", url, "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=own_log.open("w"),
        env={**env, "STREAMFENCE_SERVER_LOG_FORMAT": "json"},
    )
    wait_port(port, proc)
    return Target(name, port, proc, [proc.pid], own_log)


def proxy_fence_ms(log: Path, tag: str) -> list[float]:
    """The proxy's own fence latencies (lease superseded -> upstream closed, its clock) for
    the supersedes of one measurement, from its JSON request log."""
    out = []
    for line in log.read_text().splitlines():
        if '"superseded"' in line and tag in line:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            rid = str(entry.get("request_id", ""))
            if entry.get("msg") == "superseded" and rid.startswith(tag):
                if entry.get("fence_latency_ms") is not None:
                    out.append(float(entry["fence_latency_ms"]))
    return out


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def start_nginx(binary: str, upstream: int, workdir: Path, log: Any) -> Target:
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, upstream=upstream, port=port))
    proc = subprocess.Popen(
        [binary, "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"],
        stdout=log,
        stderr=log,
    )
    wait_port(port, proc)
    return Target("nginx", port, proc, [proc.pid, *children(proc.pid)])


def run_client(spec: dict[str, Any]) -> tuple[dict[str, Any], float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.client", json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"bench client failed on {spec['kind']} (exit {proc.returncode})")
    return json.loads(out), usage.ru_utime + usage.ru_stime


def measure(
    scenario: str, spec: dict[str, Any], target: Target, upstream: subprocess.Popen[Any], tag: str
) -> dict[str, Any]:
    spec = {**spec, "port": target.port, "tag": tag}
    if spec["kind"] == "fence" and target.name not in FENCING:
        spec["close_only"] = True  # no fence: the client closes the old stream itself
    if spec["kind"] == "fence":
        spec["load"] = {**spec["load"], "port": target.port, "tag": tag + "-load"}
    reset_peak_rss(target.pids)
    before = (cpu_seconds([upstream.pid]), cpu_seconds(target.pids))
    machine = cpu_times()
    started = time.monotonic()
    sampler = CpuSampler(target.pids) if spec["kind"] == "fence" and target.pids else None
    result, client_cpu = run_client(spec)
    wall = time.monotonic() - started
    if sampler is not None:
        result["proxy_busy_supersedes"] = sampler.stop().share(*result["supersede_window"])
    result["steal"] = steal_share(machine, cpu_times())
    result["cpu_s"] = {
        "client": client_cpu,
        "upstream": cpu_seconds([upstream.pid]) - before[0],
        "proxy": cpu_seconds(target.pids) - before[1] if target.pids else None,
    }
    result["run_s"] = wall
    if spec["kind"] == "fence" and target.log is not None:
        result["proxy_fence_ms"] = proxy_fence_ms(target.log, tag)
    if target.pids:
        result["peak_rss_mb"] = max(status_kb(p, "VmHWM") for p in target.pids) / 1024
    return result


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    sizes = SMOKE if args.smoke else FULL
    rounds = {k: 1 for k in sizes} if args.smoke else dict(ROUNDS)
    if args.rounds:
        rounds = {k: args.rounds for k in sizes}
    scenarios = [s for s in ("B1", "B2", "B3", "B5", "B4") if s in args.only]
    workdir = Path(tempfile.mkdtemp(prefix="streamfence-bench-"))
    log = (workdir / "processes.log").open("w")
    upstream, up_port = start_upstream(log)
    targets = [Target("direct", up_port)]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        targets.append(start_streamfence(up_port, log))
        if args.compare_httpx:
            targets.append(start_streamfence(up_port, log, "sf-httpx"))
        binary = None if args.no_nginx else nginx_binary()
        if binary:
            targets.append(start_nginx(binary, up_port, workdir, log))
        warm = {"kind": "ttft", "n": 20}
        for t in targets:
            measure("warmup", warm, t, upstream, "warm")
        for scenario in scenarios:
            spec = {**sizes[scenario], "upstream_port": up_port}
            eligible = targets
            raw[scenario] = {t.name: [] for t in eligible}
            for r in range(rounds[scenario]):
                order = eligible[r % len(eligible) :] + eligible[: r % len(eligible)]
                for t in order:
                    progress(f"{scenario} round {r + 1}/{rounds[scenario]}: {t.name}")
                    raw[scenario][t.name].append(
                        measure(scenario, spec, t, upstream, f"{scenario}-{t.name}-{r}")
                    )
    finally:
        for t in reversed(targets):
            t.stop()
        upstream.terminate()
        upstream.wait(10)
        log.close()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "smoke": args.smoke,
        "sizes": {s: sizes[s] for s in scenarios},
        "targets": [t.name for t in targets],
        "raw": raw,
        "summary": summarize(raw),
        "notes": [
            "B5 fence latency: from the client's send time of the newer request (an"
            " approximation of its arrival at the proxy, which can only be later) to the"
            " upstream seeing the old connection close; both on time.monotonic()."
            " direct and nginx have no fence: there the client closes the old connection"
            " itself at that moment, so their column is the floor of the same signal path"
            " (one process hop direct, two through nginx, as through streamfence)."
            " 'proxy fence' is the proxy's own measure (its JSON log): from the lease being"
            " superseded to the old upstream response closed.",
            "B5 'proxy CPU while superseding': the proxy's CPU seconds a second from the first"
            " supersede to the end of the last one (1.00: a whole core), read every 50 ms."
            " Its work runs on one thread: near 1.00 that work queues, and the supersedes"
            " wait in the queue.",
        ],
    }


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a few seconds")
    p.add_argument("--rounds", type=int, help="rounds per scenario and target")
    p.add_argument("--only", nargs="+", default=list(FULL), choices=list(FULL))
    p.add_argument("--no-nginx", action="store_true", help="skip nginx even if installed")
    p.add_argument(
        "--compare-httpx",
        action="store_true",
        help="also measure streamfence on httpx's default transport (target sf-httpx)",
    )
    p.add_argument("--out", help="JSON output file (default bench/results/<time>.json)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    # A SIGTERM (a CI timeout) still runs run()'s cleanup of the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args, progress)
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S.json", time.gmtime())
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(f"\nJSON: {out}")
    return 0
