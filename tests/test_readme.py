"""Every code block of README.md runs as written, in order, against a fresh Redis.

Console blocks run their ``$`` commands in one bash shell (so a variable set by one is
seen by the next) and must print output of the documented shape: numbers and long hex
digests may differ, words and structure may not. Python blocks run as written; those
that use names from the reader's context (the engine's URL, a request id) get them from
what the earlier blocks recorded. Blocks that need more than this suite has run where
``ELSEWHERE`` says, and a block of no known kind fails the suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r3cache.testing import RedisServer
from tests.readme import Block, blocks

ROOT = Path(__file__).resolve().parents[1]
README_URL = "redis://127.0.0.1:6379/0"  # the Redis every README command names

# (language, heading) -> where that block runs as written.
ELSEWHERE = {
    ("bash", "Quick start"): ".ci/run (make demo, make test)",
    ("bash", "With vLLM"): "tests_vllm/test_vllm_serve.py",
    ("bash", "With SGLang"): "tests_sglang/test_sglang_serve.py",
    ("python", "With SGLang"): "tests_sglang/test_sglang_serve.py",
    ("python", "Training with Megatron-Core, verl, NeMo-RL, slime"): "tests/test_megatron.py",
    ("", "Deploying"): "tests/test_acl.py",
}
# Python blocks written for a reader who already has these names: what they are here.
CONTEXT = {
    "With vLLM": {"namespace": "readback@demo", "request_id": "prompt0-sample0"},
}
_MARK = "@@r3cache-readme rc="


def _shape(text: str) -> list[str]:
    """Output lines with numbers, digests and column padding made uniform."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"[0-9a-f]{16,}", "<hex>", line)
        line = re.sub(r"\d[\d,]*(\.\d+)?", "<n>", line)
        line = " ".join(line.split())
        if line:
            lines.append(line)
    return lines


def _console(block: Block) -> list[tuple[str, list[str]]]:
    """A console block's commands, each with the output lines shown under it."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise AssertionError(f"{block}: output before any command: {line!r}")
    return steps


def _run_console(block: Block, server: RedisServer, cwd: Path) -> None:
    steps = _console(block)
    # redis-cli formats replies as on a terminal (the README shows them so) on the test's port.
    cli = f'redis-cli() {{ command redis-cli --no-raw -p {server.port} "$@"; }}'
    script = ["set -u", cli]
    for command, _ in steps:
        script += [command.replace(README_URL, server.url), f'echo "{_MARK}$?"']
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)
    outputs = re.split(rf"^{re.escape(_MARK)}(\d+)$", done.stdout, flags=re.M)
    for i, (command, expected) in enumerate(steps):
        assert 2 * i + 1 < len(outputs), f"{block}: `{command}` never ended\n{done.stderr}"
        printed, rc = outputs[2 * i], int(outputs[2 * i + 1])
        assert rc == 0, f"{block}: `{command}` exited {rc}\n{printed}{done.stderr}"
        assert _shape(printed) == _shape("\n".join(expected)), (
            f"{block}: `{command}` printed\n{printed}\nwhere the README shows\n"
            + "\n".join(expected))


def _run_python(block: Block, server: RedisServer, cwd: Path) -> None:
    names = {"url": server.url, **CONTEXT.get(block.heading, {})}
    code = compile(block.text.replace(README_URL, server.url), str(block), "exec")
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        exec(code, names)
    finally:
        os.chdir(previous)


def test_every_block_is_of_a_kind_some_test_runs():
    for block in blocks():
        assert block.lang in ("console", "python") or (block.lang, block.heading) in ELSEWHERE, (
            f"{block}: no test runs it; run it here or name where in ELSEWHERE")
    for (lang, heading), where in ELSEWHERE.items():
        assert any(b.lang == lang and b.heading == heading for b in blocks()), (
            f"{where} runs a {lang or 'plain'} block under {heading!r} that README lacks")


def test_the_readme_runs_as_written(tmp_path):
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    here = [b for b in blocks() if (b.lang, b.heading) not in ELSEWHERE]
    # Blocks that take names from the reader's context run once the rest has made them.
    ordered = ([b for b in here if b.heading not in CONTEXT]
               + [b for b in here if b.heading in CONTEXT])
    with RedisServer() as server:
        for block in ordered:
            if block.lang == "console":
                _run_console(block, server, tmp_path)
            else:
                _run_python(block, server, tmp_path)


def test_the_engine_guide_runs_as_written(tmp_path):
    """docs/ENGINE.md, which the README points engine authors to."""
    guide = blocks(ROOT / "docs" / "ENGINE.md")
    assert [b.lang for b in guide] == ["python"]
    with RedisServer() as server:
        _run_python(guide[0], server, tmp_path)


def test_the_quick_start_commands_are_what_ci_runs():
    quick = next(b for b in blocks() if (b.lang, b.heading) == ("bash", "Quick start"))
    targets = [line.split("#")[0].split()[1] for line in quick.text.splitlines()
               if line.startswith("make ")]
    ci = (ROOT / ".ci" / "run").read_text()
    ran = re.search(r"^for target in (.+); do$", ci, flags=re.M).group(1).split()
    assert targets == ["demo", "test"]
    assert ran[: len(targets)] == targets


@pytest.mark.parametrize("block", [b for b in blocks() if b.lang == "console"], ids=str)
def test_console_blocks_show_commands_with_their_output(block):
    assert _console(block), f"{block} runs nothing"
