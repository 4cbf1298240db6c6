import subprocess
import sys


def test_demo_runs_and_verifies():
    result = subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "demo", "--prompts", "3", "--samples", "4",
         "--layers", "8"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "verification: PASS" in out
    assert "requests              12" in out
    for line in ("blocks published", "blocks reused", "raw bytes stored", "connector time/step"):
        assert line in out


def test_demo_help_explains_the_options():
    result = subprocess.run([sys.executable, "-m", "r3cache.cli", "demo", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--store" in result.stdout and "GRPO" in result.stdout
