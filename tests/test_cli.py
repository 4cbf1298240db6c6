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


def test_block_decodes_one_stored_block(redis_url, namespace, tmp_path):
    import numpy as np

    from r3cache import RoutingLayout, open_store

    layout = RoutingLayout(3, 2, 16, 4)
    rows = np.arange(24, dtype=np.uint8).reshape(4, 3, 2) % 16
    store = open_store(redis_url, layout=layout, namespace=namespace, owner="cli-test")
    store.put({"abc123": rows}, retain_keys=["abc123"])
    out = tmp_path / "block.npy"
    result = subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "block", redis_url, "abc123", "--namespace",
         namespace, "--out", str(out)], capture_output=True, text=True, timeout=60)
    store.close()
    assert result.returncode == 0, result.stderr
    assert "holders   cli-test=1" in result.stdout and "none (pinned)" in result.stdout
    assert f"layout    {layout.fingerprint}" in result.stdout
    np.testing.assert_array_equal(np.load(out), rows)
    missing = subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "block", redis_url, "nope", "--namespace",
         namespace], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no block nope" in missing.stdout


def test_demo_runs_against_redis(redis_url, namespace):
    result = subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "demo", "--store", redis_url, "--namespace",
         namespace, "--prompts", "2", "--samples", "3", "--layers", "4"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "verification: PASS" in result.stdout
