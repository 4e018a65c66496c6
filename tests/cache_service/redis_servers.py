"""Redis servers the cache tests own: a standalone server, a 3-node cluster, a TCP proxy.

The shared Redis at REDIS_URL is never stopped or flushed; fault tests use these instead. Every
server binds 127.0.0.1 on a free port, keeps no data on disk and is stopped by its owner.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.conftest import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (p, p + 10000) for a cluster node")


def have_redis_server() -> bool:
    return Path(REDIS_SERVER).exists() and Path(REDIS_CLI).exists()


class RedisServer:
    """One redis-server process on a free loopback port (or a given one, for restarts)."""

    def __init__(self, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="moe-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class RedisCluster3:
    """Three cluster-enabled redis-servers joined by `redis-cli --cluster create`."""

    def __init__(self) -> None:
        self.nodes = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--cluster-config-file",
                "nodes.conf",
                port=free_cluster_port(),
            )
            for _ in range(3)
        ]

    def start(self) -> RedisCluster3:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = subprocess.run(
                [REDIS_CLI, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            if "cluster_state:ok" in info:
                return self
            time.sleep(0.2)
        raise RuntimeError("the 3-node test cluster did not reach cluster_state:ok in 20 s")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


class TcpProxy:
    """A loopback TCP proxy to a backend port that a test can cut and restore.

    `cut()` closes every open connection and refuses new ones (accepted sockets are closed at
    once); `restore()` forwards again.
    """

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._open = True
        self._stop = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if not self._open:
                client.close()
                continue
            try:
                backend = socket.create_connection(("127.0.0.1", self.backend_port), timeout=1)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, backend]
            for src, dst in ((client, backend), (backend, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def cut(self) -> None:
        self._open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        self._open = True

    def close(self) -> None:
        self._stop = True
        self.cut()
        self._thread.join(timeout=2)
        self._listener.close()
