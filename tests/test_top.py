"""`r3cache top` in a real terminal (tmux): what it draws, and that q and Ctrl-C end it;
and where stdout is no terminal, plain snapshots."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from r3cache import RoutingLayout, open_store
from r3cache.sim import SimConfig, SimRequest, simulate
from r3cache.testing import RedisServer

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
ROOT = Path(__file__).resolve().parents[1]


class Terminal:
    """Own a tmux server of its own running one command in a 120 x 40 pane."""

    def __init__(self, command: str, status: Path) -> None:
        self.socket = f"r3cache-test-{uuid.uuid4().hex[:8]}"
        self.status = status
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
        # The exit status goes to a file; the pane stays until the test has read it.
        self._tmux("new-session", "-d", "-x", "120", "-y", "40",
                   f"{command}; echo $? > {status}; sleep 60", env=env)

    def _tmux(self, *args: str, env=None) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], env=env, check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def wait_for(self, *texts: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if all(t in screen for t in texts):
                return screen
            assert time.monotonic() < deadline, f"never showed {texts}:\n{screen}"
            time.sleep(0.2)

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", *keys)

    def exit_status(self, timeout: float = 15) -> int:
        deadline = time.monotonic() + timeout
        while not self.status.exists() or not self.status.read_text().strip():
            assert time.monotonic() < deadline, f"still running:\n{self.screen()}"
            time.sleep(0.1)
        return int(self.status.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []
    yield lambda command, status: opened.append(Terminal(command, status)) or opened[-1]
    for terminal in opened:
        terminal.close()


def _top(url: str, *args: str) -> str:
    return f"{sys.executable} -m r3cache.cli top {url} --interval 0.5 {' '.join(args)}"


@needs_tmux
def test_top_shows_the_namespace_and_rates_and_quits_on_q(terminals, tmp_path):
    layout = RoutingLayout(4, 2, 16, 4)
    with RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru") as server:
        workload = [SimRequest(f"r{i}", list(range(20)), list(range(i, i + 9)))
                    for i in range(3)]
        simulate(workload, layout, SimConfig(keep_manifests=True), store_url=server.url,
                 namespace="top-test", idle_ttl=300)
        store = open_store(server.url, layout=layout, namespace="top-test")
        stats = store.stats()
        store.close()
        term = terminals(_top(server.url), tmp_path / "status")
        screen = term.wait_for("top-test  layout r3l1:L4:K2:E16:B4:|u1", "rates")
        assert f"blocks     {stats.blocks:,} ({stats.pinned_blocks:,} pinned" in screen
        assert "manifests  3" in screen
        assert "of 67,108,864 (" in screen and "policy volatile-lru" in screen
        assert "WARNING" not in screen
        term.keys("q")
        assert term.exit_status() == 0


@needs_tmux
def test_top_warns_of_an_eviction_policy_that_can_drop_held_blocks_and_ends_on_ctrl_c(
        terminals, tmp_path):
    with RedisServer("--maxmemory-policy", "allkeys-lru") as server:
        open_store(server.url, layout=RoutingLayout(4, 2, 16, 4), namespace="evictable").close()
        term = terminals(_top(server.url, "--namespace", "evictable"), tmp_path / "status")
        term.wait_for("evictable", "WARNING    maxmemory-policy is not volatile-*")
        term.keys("C-c")
        assert term.exit_status() == 0
        assert "Traceback" not in term.screen()


@needs_tmux
def test_top_watches_through_a_redis_outage_and_goes_on_when_it_answers(terminals, tmp_path):
    """Redis stalls while top watches: top keeps the last look on screen under a line that
    says Redis is unavailable, draws fresh looks once it answers again, and q ends it."""
    with RedisServer() as server:
        open_store(server.url, layout=RoutingLayout(4, 2, 16, 4), namespace="watched").close()
        url = f"'{server.url}?retries=0&socket_timeout=0.3&socket_connect_timeout=0.3'"
        term = terminals(_top(url, "--namespace", "watched"), tmp_path / "status")
        term.wait_for("watched  layout r3l1:L4:K2:E16:B4:|u1", "rates")
        server.process.send_signal(signal.SIGSTOP)
        try:
            term.wait_for("UNAVAILABLE", "Redis unavailable", "watched  layout")
        finally:
            server.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while "UNAVAILABLE" in (screen := term.screen()):
            assert time.monotonic() < deadline, f"never came back:\n{screen}"
            time.sleep(0.2)
        assert "watched  layout" in screen and "rates" in screen
        term.keys("q")
        assert term.exit_status() == 0


def _ctrl_c_as_in_a_shell() -> None:
    """SIGINT at its default in the child, as a shell's foreground command has it: a
    suite started in the background (`cmd &`) ignores SIGINT, its children inherit that,
    and Python then raises no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_top_prints_plain_snapshots_where_stdout_is_no_terminal_and_ends_on_ctrl_c():
    """A pipe, a file or `kubectl exec` without -t: no screen to draw on, so each snapshot
    is printed as lines, and Ctrl-C ends it as in a terminal."""
    with RedisServer() as server:
        open_store(server.url, layout=RoutingLayout(4, 2, 16, 4), namespace="piped").close()
        top = subprocess.Popen(_top(server.url, "--namespace", "piped").split(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)},
                               preexec_fn=_ctrl_c_as_in_a_shell)
        time.sleep(3)  # the interpreter's start, then snapshots every 0.5 s
        top.send_signal(signal.SIGINT)
        out, err = top.communicate(timeout=30)
    assert top.returncode == 0, err
    frames = out.strip().split("\n\nr3cache top  ")
    assert len(frames) >= 2, out
    assert "piped  layout r3l1:L4:K2:E16:B4:|u1" in frames[0] and "rates" in frames[1]
    assert "\x1b" not in out and "Traceback" not in err


def test_top_never_shows_a_password_of_its_url():
    """The header names the server, not its credentials: plain snapshots go to logs."""
    with RedisServer() as server:
        server.client().config_set("requirepass", "s3cret-pw")
        for url in (f"redis://default:s3cret-pw@127.0.0.1:{server.port}/0",
                    f"redis://127.0.0.1:{server.port}/0?password=s3cret-pw&retries=1"):
            top = subprocess.Popen([sys.executable, "-m", "r3cache.cli", "top", url],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)},
                                   preexec_fn=_ctrl_c_as_in_a_shell)
            time.sleep(2)
            top.send_signal(signal.SIGINT)
            out, err = top.communicate(timeout=30)
            assert top.returncode == 0, err
            assert f"r3cache top  redis://127.0.0.1:{server.port}/0" in out
            assert "s3cret" not in out + err
