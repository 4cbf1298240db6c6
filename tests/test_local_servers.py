"""`python -m r3cache.testing`: local servers for a developer's shell, gone when it ends."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_killed_local_server_stops_its_redis_and_removes_its_files(sig):
    runner = subprocess.Popen([sys.executable, "-m", "r3cache.testing", "redis"],
                              stdout=subprocess.PIPE, text=True)
    client = redis.Redis.from_url(runner.stdout.readline().strip(), socket_timeout=2)
    directory = Path(client.config_get("dir")["dir"])
    try:
        runner.send_signal(sig)
        assert runner.wait(timeout=30) == 0
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        assert not directory.exists()
    finally:  # what a failed run leaves
        if runner.poll() is None:
            runner.kill()
        with contextlib.suppress(redis.exceptions.RedisError):
            client.shutdown(nosave=True)
        shutil.rmtree(directory, ignore_errors=True)
