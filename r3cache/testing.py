"""Local ``redis-server`` processes and a 6-node Redis Cluster for tests and benchmarks.

Everything binds to 127.0.0.1 on free ports and lives in a temporary directory that
``stop()`` removes. Usable as context managers, or from the shell::

    python -m r3cache.testing cluster   # prints the URL, runs until Ctrl-C or kill
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from r3cache.errors import ContractError


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@functools.cache
def _listening_ports() -> tuple[int, ...]:
    """Ports that neither the kernel's range for outgoing connections nor its +10000 cluster
    bus port falls in: any port in that range can be taken by some process's connect()
    between the check that it is free and the server's bind (a minute, for an engine)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default; macOS's 49152-65535 lies above it
    outgoing = range(low, high + 1)
    ports = tuple(p for p in range(10000, 65536 - 10000)
                  if p not in outgoing and p + 10000 not in outgoing)
    return ports or tuple(range(20000, 54000))


_handed_out: set[int] = set()  # a port handed out once may not be bound yet


def free_port() -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too; never
    one this process handed out before, nor one an outgoing connection can be given."""
    ports = _listening_ports()
    for _ in range(1000):
        port = random.choice(ports)
        if port not in _handed_out and _port_free(port) and _port_free(port + 10000):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port pair found")


class RedisServer:
    """Own one redis-server process on a free loopback port, with its own directory."""

    def __init__(self, *args: str, port: int | None = None, directory: Path | None = None,
                 ready: bool = True, config_file: Path | None = None):
        self.port = port or free_port()
        self.config_file = config_file  # its settings apply, unless ``args`` override them
        self._check_ready = ready  # False: a TLS-only server cannot be pinged in plain text
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="r3cache-redis-"))
        self.args = list(args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServer:
        command = [shutil.which("redis-server") or "redis-server"]
        if self.config_file is not None:
            command.append(str(self.config_file))
        else:  # a throwaway server: nothing on disk
            command += ["--save", "", "--appendonly", "no"]
        command += ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                    "--logfile", str(self.dir / "redis.log"), *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        if self._check_ready:
            self.wait_ready(timeout)
        else:
            self._wait_listening(timeout)
        return self

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while _port_free(self.port):
            if time.monotonic() > deadline or (self.process and self.process.poll() is not None):
                raise RuntimeError(f"redis-server on {self.port} not listening: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        # One try a poll: redis-py retries a refused connection (an AuthenticationError
        # too) with backoff, seconds in all, and this loop polls every 20 ms itself.
        once = Retry(NoBackoff(), 0)
        while True:
            try:
                if self.client(socket_timeout=1, retry=once).ping():
                    return
            except redis.exceptions.AuthenticationError:
                return  # it answers; it wants credentials
            except redis.exceptions.ResponseError as exc:
                if "NOAUTH" in str(exc):
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                pass
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} not ready: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text()[-2000:] if log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process with ``sig`` (SIGKILL by default) and wait for it to go."""
        if sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGCONT):
            # The process would not go: the wait would end in a SIGKILL 10 s later.
            raise ContractError(f"kill() ends the server; stall it with "
                                f"process.send_signal({signal.Signals(sig).name})")
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterProcesses:
    """Own six redis-server processes joined as 3 primaries with one replica each."""

    def __init__(self, *args: str, node_timeout_ms: int = 2000,
                 config_file: Path | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="r3cache-cluster-"))
        self.args = list(args)
        self.node_timeout_ms = node_timeout_ms
        self.config_file = config_file
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])
        return f"redis+cluster://{hosts}"

    def start(self, timeout: float = 30.0) -> RedisClusterProcesses:
        try:
            for i in range(6):
                node_dir = self.dir / f"node{i}"
                node_dir.mkdir()
                # As deploy/redis-cluster.conf: a primary's one replica syncs as soon as it
                # connects, not after the default 5 s wait for more replicas (which every
                # start, and every node's rejoin after a failover, would wait out).
                cluster_args = ([] if self.config_file else [
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--repl-diskless-sync-max-replicas", "1"])
                self.nodes.append(RedisServer(
                    *cluster_args, *self.args, directory=node_dir, config_file=self.config_file,
                ).start())
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1",
                 "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
            )
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports cluster_state:ok and the replicas are synced."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [n for n in self.nodes if n.process is not None]
                if all(n.client(socket_timeout=1).cluster("info")["cluster_state"] == "ok"
                       for n in live) and self._replicas_synced(live):
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    @staticmethod
    def _replicas_synced(live: list[RedisServer]) -> bool:
        for node in live:
            info = node.client(socket_timeout=1).info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def primaries(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None
                and n.client().info("replication")["role"] == "master"]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        self.nodes = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcesses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def machine_redis(prefix: str, url: str | None = None):
    """The URL of the Redis that answers at ``url`` (``R3CACHE_TEST_REDIS``, else
    127.0.0.1:6379), or of a spawned redis-server; on exit, the keys and registrations of
    namespaces named ``prefix*`` on the former are deleted."""
    url = url or os.environ.get("R3CACHE_TEST_REDIS", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except redis.exceptions.RedisError:
        with RedisServer() as server:
            yield server.url
        return
    yield url
    client = redis.Redis.from_url(url)
    keys = client.scan_iter(match=f"r3:{prefix}*", count=1000)
    while batch := list(itertools.islice(keys, 1000)):
        client.unlink(*batch)  # a test session leaves tens of thousands: not one call each
    for name in client.smembers("r3:namespaces"):
        if name.startswith(prefix.encode()):
            client.srem("r3:namespaces", name)


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else "cluster"
    runner = RedisClusterProcesses() if kind == "cluster" else RedisServer()
    # A plain kill (SIGTERM) or a closed terminal (SIGHUP) ends it as Ctrl-C does, the
    # servers stopped and their files removed: by default either would leave them running.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    # Suppressed outside the servers' block: a signal that comes as soon as the URL is
    # out (before the pause) still stops them and ends the process cleanly.
    with contextlib.suppress(KeyboardInterrupt), runner:
        print(runner.url, flush=True)
        signal.pause()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
