"""The SGLang suite: real SGLang 0.5.23 on this CPU, real redis-server processes.

Run by `make test-sglang` in its own virtual environment; the default suite (`make test`)
never collects this folder. SGLang runs as its users run it, `python -m
sglang.launch_server` with the r3cache plugin, answering HTTP. On this CPU (not a
configuration SGLang supports) it needs the test tree's shims (``shims/``, on the server's
PYTHONPATH) and the flags in ``CPU_FLAGS``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from r3cache.testing import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # tests/: the tiny model, the README's blocks
from tests.engine_fixtures import redis_fixtures  # noqa: E402 - needs ROOT on the path

SHIMS = HERE / "shims"
SGLANG_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # else rotary embedding imports vLLM
    "PYTHONPATH": os.pathsep.join([str(SHIMS), str(ROOT)]),
}
# Torch-native attention, no CUDA graphs, a small KV pool: SGLang on a CPU.
CPU_FLAGS = ("--device cpu --attention-backend torch_native --disable-cuda-graph "
             "--mem-fraction-static 0.05 --max-total-tokens 8192 --skip-server-warmup "
             "--log-level warning")
# This session's namespaces, and only these, are deleted from the shared Redis at its end.
SESSION = f"test-sglang-{uuid.uuid4().hex[:8]}"
SYSTEM = " ".join(f"w{i}" for i in range(10, 60))  # a 50-token shared system prompt


def grpo_prompts(groups: int = 3, samples: int = 4, first_word: int = 100) -> list[str]:
    """``groups`` prompts under one system prompt, each sent ``samples`` times; prompts of
    another ``first_word`` share no block but the system prompt's."""
    return [f"{SYSTEM} " + " ".join(f"w{first_word + 10 * g + i}" for i in range(12 + g))
            for g in range(groups) for _ in range(samples)]


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    # Built with the shims, as the servers run: transformers imports torchvision.
    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    subprocess.run([sys.executable, "-m", "tests.tiny_model", str(out)], check=True,
                   cwd=ROOT, env={**os.environ, **SGLANG_ENV}, stdout=subprocess.DEVNULL)
    return out


redis_url, cluster_url = redis_fixtures(f"{SESSION}-")


def new_namespace() -> str:
    return f"{SESSION}-{uuid.uuid4().hex[:8]}"


class Server:
    """Own one SGLang server process group, started from a shell command line."""

    def __init__(self, command: str, env: dict[str, str], port: int) -> None:
        self.port = port
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
        full_env.update(SGLANG_ENV)
        full_env.update(env)
        # `python` is this venv's, as in the shell of a user who activated it.
        full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env['PATH']}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-{port}.log"
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(["bash", "-c", command], env=full_env,
                                        stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"SGLang exited ({self.process.returncode}):\n"
                                     f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"SGLang did not answer in {timeout:g} s:\n{self.log_tail()}")

    def generate(self, texts: list[str], *, max_new_tokens: int = 8,
                 temperature: float = 1.0, routes: bool = True,
                 start_len: int | None = None, rids: list[str] | None = None) -> list[dict]:
        body = {"text": texts, "return_routed_experts": routes,
                "sampling_params": {"max_new_tokens": max_new_tokens,
                                    "temperature": temperature, "ignore_eos": True}}
        if start_len is not None:
            body["routed_experts_start_len"] = start_len
        if rids is not None:
            body["rid"] = rids
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def log_tail(self, chars: int = 6000) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log_file.close()


def serve(model: Path, env: dict[str, str], flags: str = "--enable-return-routed-experts",
          command: str | None = None) -> Server:
    """SGLang's server on the tiny model with the plugin, starting: ``command`` (the
    launch_server line of the README, say), or ``python -m sglang.launch_server``."""
    # Both ports from this process, so that two servers starting side by side never get the
    # same one: SGLang's own pick of its torch.distributed port knows nothing of the other.
    port, nccl_port = free_port(), free_port()
    command = command or (f"python -m sglang.launch_server --model-path "
                          f"{shlex.quote(str(model))} {flags}")
    return Server(f"{command} --host 127.0.0.1 --port {port} --nccl-port {nccl_port} "
                  f"{CPU_FLAGS}", env, port)
