"""A real `redis-server` for tests: a free loopback port, a temp dir, no persistence.

`RedisServer.start()` returns once the server logs that it accepts connections (an event,
not a sleep); `kill()` sends SIGKILL, like a crash; `start()` again brings it back on the
same port, empty, as a restarted Redis without persistence would be.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.config.schema import RegistryConfig
from proxy.registry.redis import RedisRegistry
from tests.scripted import free_port

REDIS_SERVER = shutil.which("redis-server")
READY_LINE = "Ready to accept connections"


class PortTaken(RuntimeError):
    pass


class RedisServer:
    def __init__(self, workdir: str, port: int | None = None, *, cluster: bool = False) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.cluster = cluster
        # The cluster bus port defaults to port + 10000, which may be taken or out of range.
        self.bus_port = free_port() if cluster else 0
        self.started = False
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        for _ in range(3):
            try:
                self._start(timeout)
                self.started = True
                return
            except PortTaken:
                if self.started:
                    raise  # a restart must keep its port
                # free_port() only found the port free: something else may take it before
                # redis-server binds it (a client's ephemeral port). Try other ports.
                self.port = free_port()
                self.bus_port = free_port() if self.cluster else 0
        self._start(timeout)

    def _start(self, timeout: float) -> None:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        assert self.proc is None, "already running"
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.workdir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "notice",
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-port", str(self.bus_port), "--cluster-node-timeout", "2000"]
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.proc = proc
        ready = threading.Event()
        lines: list[str] = []

        def drain() -> None:
            # Reads the server's log to its end, so it never blocks on a full pipe.
            assert proc.stdout is not None
            for line in proc.stdout:
                if len(lines) < 200:
                    lines.append(line)
                if READY_LINE in line:
                    ready.set()
            proc.stdout.close()
            ready.set()  # exited: start() reports it

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.stop()
            log = "".join(lines)
            if "Address already in use" in log:
                raise PortTaken(log)
            raise RuntimeError("redis-server did not become ready:\n" + log)

    async def astart(self) -> None:
        """`start()` without blocking the event loop that runs the proxies under test."""
        await asyncio.to_thread(self.start)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without a goodbye, as in a crash."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="streamfence-redis-") as workdir:
        server = RedisServer(workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()


REDIS_CLI = shutil.which("redis-cli")


class RedisClusterServer:
    """Three masters on loopback, no replicas: the smallest real Redis Cluster.

    The same interface as `RedisServer` (url, start, astart, kill, stop). Each node keeps
    its cluster config file (node id, slots) in its own dir, so `kill()` then `start()`
    brings the same cluster back, empty: a cluster restarted without persistence.
    """

    def __init__(self, workdir: str) -> None:
        self.nodes = []
        for i in range(3):
            path = os.path.join(workdir, f"node-{i}")
            os.makedirs(path)
            self.nodes.append(RedisServer(path, cluster=True))
        self.created = False

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        for node in self.nodes:
            node.start()
        if not self.created:
            assert REDIS_CLI is not None, "redis-cli is not installed (apt-get install redis-tools)"
            addresses = [f"127.0.0.1:{port}" for port in self.ports]
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0"]
                + ["--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            self.created = True
        self.wait_ok(timeout)

    def wait_ok(self, timeout: float) -> None:
        """Until every node reports the cluster up and agrees on all 16384 slots: only
        then does a client see one consistent cluster. Polls: gossip has no event."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self._node_ok(port) for port in self.ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not come up")
            time.sleep(0.05)

    @staticmethod
    def _node_ok(port: int) -> bool:
        assert REDIS_CLI is not None
        out = subprocess.run(
            [REDIS_CLI, "-p", str(port), "cluster", "info"], capture_output=True, text=True
        ).stdout
        return "cluster_state:ok" in out and "cluster_slots_ok:16384" in out

    async def astart(self) -> None:
        await asyncio.to_thread(self.start)

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def flush(self) -> None:
        """Empty every node (between tests sharing one cluster)."""
        assert REDIS_CLI is not None
        for port in self.ports:
            subprocess.run(
                [REDIS_CLI, "-p", str(port), "flushall"], check=True, capture_output=True
            )


@contextmanager
def running_cluster() -> Iterator[RedisClusterServer]:
    with tempfile.TemporaryDirectory(prefix="streamfence-cluster-") as workdir:
        cluster = RedisClusterServer(workdir)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


# One Redis server, or a three-master Redis Cluster: the registry's tests run on both.
Server = RedisServer | RedisClusterServer
BACKENDS = [
    "single",
    pytest.param(
        "cluster", marks=pytest.mark.skipif(REDIS_CLI is None, reason="redis-cli is not installed")
    ),
]


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[RedisClusterServer]:
    """One cluster for the tests that leave it running (it takes ~2 s to form)."""
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_server(shared_cluster: RedisClusterServer) -> Iterator[RedisClusterServer]:
    """The shared cluster, emptied, for one test."""
    shared_cluster.flush()
    # Before too: a connection an earlier test's cluster client dropped may have stayed
    # referenced past that test's teardown (seen in CI, twice, in the same test).
    _collect_dropped_connections()
    try:
        yield shared_cluster
    finally:
        _collect_dropped_connections()


@pytest.fixture(params=BACKENDS)
def redis_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    if request.param == "cluster":
        yield request.getfixturevalue("cluster_server")
        return
    with running_redis() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def restartable_redis(request: pytest.FixtureRequest) -> Iterator[Server]:
    """For tests that kill Redis: a server, or a cluster of its own."""
    try:
        if request.param == "cluster":
            with running_cluster() as cluster:
                yield cluster
            return
        with running_redis() as server:
            yield server
    finally:
        _collect_dropped_connections()


def _collect_dropped_connections() -> None:
    # redis-py's cluster client drops a connection from its pool when its disconnect fails
    # (a killed node, a command cancelled mid-reply: seen in CI on a cluster no test killed),
    # and such a socket is closed only when collected: at some random later point, as a
    # ResourceWarning in whichever test runs then. Collect here, where it belongs, once this
    # test's loop has ended.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
def single_redis() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@asynccontextmanager
async def redis_client(server: Server) -> AsyncIterator[Redis | RedisCluster]:
    client: Redis | RedisCluster
    if isinstance(server, RedisClusterServer):
        client = RedisCluster(host="127.0.0.1", port=server.ports[0])
    else:
        client = Redis.from_url(server.url)
    try:
        yield client
    finally:
        await client.aclose()


@asynccontextmanager
async def registries(server: Server, n: int = 2) -> AsyncIterator[list[RedisRegistry]]:
    """n registries with clients of their own: n processes, as far as Redis can tell."""
    regs = [RedisRegistry(RegistryConfig(backend="redis", url=server.url)) for _ in range(n)]
    for reg in regs:
        await reg.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait_subscribed() for r in regs)), 10)
        yield regs
    finally:
        for reg in regs:
            await reg.close()
