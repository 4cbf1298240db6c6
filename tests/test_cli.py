import contextlib
import subprocess
import sys

import pytest


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


@pytest.mark.parametrize(("args", "problem"), [
    (["--store", "memory://?max_bytes=abc"], "max_bytes must be a number"),
    (["--store", "redis://127.0.0.1:1?socket_keepalive=maybe"], "socket_keepalive is a flag"),
    (["--store", "redis://127.0.0.1:1", "--namespace", "a b"], "namespace 'a b' must be"),
    (["--namespace", ""], "namespace must be a non-empty string"),
])
def test_demo_refuses_its_store_and_namespace_before_it_starts(args, problem):
    """Before a model loads or a workload is drawn (minutes, for --prompts 100000): the
    model named here does not exist, and the store's mistake is the one told."""
    result = cli("demo", *args, "--model", "no-such-model")
    assert result.returncode == 2 and problem in result.stderr, result.stderr


def test_demo_help_explains_the_options():
    result = subprocess.run([sys.executable, "-m", "r3cache.cli", "demo", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--store" in result.stdout and "GRPO" in result.stdout


def test_every_argument_of_every_subcommand_says_what_it_is():
    import argparse

    from r3cache.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) >= {"demo", "gc", "block", "inspect", "get", "export", "plot"}
    for name, command in sub.choices.items():
        assert command.description, name
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            # Real words, not a bare example value such as "load.png".
            assert action.help and len(action.help.split()) >= 3, what


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
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"r3cache block: BlockNotFoundError: 1 block(s) missing in namespace {namespace!r}: "
        "nope (likely cause: never written, or evicted after its last release)"]


def test_demo_reports_its_store_without_the_password():
    from r3cache.testing import RedisServer

    with RedisServer() as server:
        server.client().config_set("requirepass", "s3cret-pw")
        for url in (f"redis://:s3cret-pw@127.0.0.1:{server.port}/0",
                    f"redis://127.0.0.1:{server.port}/0?password=s3cret-pw"):
            result = cli("demo", "--store", url, "--namespace", "demo-secret", "--prompts",
                         "1", "--samples", "2", "--layers", "2")
            assert result.returncode == 0, result.stderr
            assert f"store=redis://127.0.0.1:{server.port}/0  " in result.stdout
            assert "s3cret" not in result.stdout + result.stderr


def test_demo_runs_against_redis(redis_url, namespace):
    result = subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "demo", "--store", redis_url, "--namespace",
         namespace, "--prompts", "2", "--samples", "3", "--layers", "4"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "verification: PASS" in result.stdout


@pytest.fixture(params=["redis", "cluster"])
def recorded(request, namespace):
    """A namespace with three recorded requests, on standalone Redis and on the cluster."""
    from r3cache import RoutingLayout
    from r3cache.sim import SimConfig, SimRequest, simulate

    url = request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")
    layout = RoutingLayout(4, 2, 16, 4)
    workload = [SimRequest(f"req-{i}", list(range(20)), list(range(i, i + 9))) for i in range(3)]
    report = simulate(workload, layout, SimConfig(keep_manifests=True), store_url=url,
                      namespace=namespace, idle_ttl=300)
    assert report.manifests_verified == 3
    return url, report.online


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "r3cache.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_inspect_shows_layout_counts_and_owners(recorded, namespace):
    url, _ = recorded
    result = cli("inspect", url, "--namespace", namespace)
    assert result.returncode == 0, result.stderr
    assert "layout r3l1:L4:K2:E16:B4:|u1  hash sha256" in result.stdout
    assert "manifests  3" in result.stdout and "0 live" in result.stdout
    # The engine's R3CACHE_URL, with its plugin's options, shows the same.
    engine_url = f"{url}{'&' if '?' in url else '?'}store_wait=5&writer=process"
    assert cli("inspect", engine_url, "--namespace", namespace).stdout == result.stdout


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_namespace_deleted_by_hand_stops_no_command_over_every_namespace(where, namespace):
    """Its keys deleted with redis-cli, a namespace's name stays in r3:namespaces: inspect,
    top and gc over every namespace stopped at its missing layout. A name r3cache never
    writes, added there by hand, is passed over too."""
    import redis

    from r3cache import RoutingLayout, open_store
    from r3cache.inspection import snapshot
    from r3cache.testing import RedisClusterProcesses, RedisServer

    # Servers of its own: every namespace of a shared one would be listed, and another
    # test's could go between the listing and the look.
    with contextlib.ExitStack() as stack:
        if where == "standalone":
            server = stack.enter_context(RedisServer())
            url, client = server.url, server.client()
        else:
            url = stack.enter_context(RedisClusterProcesses()).url
            host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
            client = redis.RedisCluster(host=host, port=int(port))
        stack.callback(client.close)
        gone = f"{namespace}-gone"
        for name in (namespace, gone):
            open_store(url, layout=RoutingLayout(4, 2, 16, 4), namespace=name).close()
        for key in (f"r3:{gone}:meta", f"r3:{gone}:owners"):
            client.delete(key)
        client.sadd("r3:namespaces", "not a namespace")
        inspected = cli("inspect", url)
        assert inspected.returncode == 0, inspected.stderr
        assert f"{namespace}  layout" in inspected.stdout and gone not in inspected.stdout
        collected = cli("gc", url)
        assert collected.returncode == 0, collected.stderr
        assert f"{namespace}: 0 live owner(s)" in collected.stdout
        assert [n.namespace for n in snapshot(url).namespaces] == [namespace]


def test_get_writes_npy_and_safetensors(recorded, namespace, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    url, online = recorded
    assert cli("get", url, "req-1", "--namespace", namespace, "--out",
               str(tmp_path / "r.npy")).returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "r.npy"), online["req-1"])
    result = cli("get", url, "req-2", "--namespace", namespace, "--out",
                 str(tmp_path / "r.safetensors"), "--dtype", "int64")
    assert result.returncode == 0, result.stderr
    tensor = load_file(str(tmp_path / "r.safetensors"))["routed_experts"]
    assert tensor.dtype == np.int64
    np.testing.assert_array_equal(tensor, online["req-2"])
    missing = cli("get", url, "nope", "--namespace", namespace, "--out", str(tmp_path / "x.npy"))
    assert missing.returncode == 2 and "ManifestNotFoundError" in missing.stderr


def test_get_writes_the_file_it_names_or_refuses_before_reading(recorded, namespace,
                                                                 tmp_path):
    """`--out routes` wrote routes.npy and printed "-> routes"; a missing safetensors
    package exited 1 with a bare message. Each is now one line, exit 2, no file."""
    url, _ = recorded
    for out in (tmp_path / "routes", tmp_path / "routes.txt", tmp_path):
        result = cli("get", url, "req-1", "--namespace", namespace, "--out", str(out))
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"r3cache get: ContractError: --out {out}: name a .npy or a .safetensors file"]
    without = ("import sys; sys.modules['safetensors'] = None; from r3cache.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", without, "get", url, "req-1", "--namespace",
                             namespace, "--out", str(tmp_path / "r.safetensors")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "r3cache get: ContractError: writing .safetensors needs the safetensors package: "
        "pip install 'r3cache[cli]'"]
    assert list(tmp_path.iterdir()) == []


def test_export_writes_every_request_and_an_index(recorded, namespace, tmp_path):
    import json

    import numpy as np

    url, online = recorded
    result = cli("export", url, "--namespace", namespace, "--out", str(tmp_path / "dir"))
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "dir" / "index.json").read_text())
    assert sorted(r["request_id"] for r in index["requests"]) == ["req-0", "req-1", "req-2"]
    for entry in index["requests"]:
        rows = np.load(tmp_path / "dir" / entry["file"])
        np.testing.assert_array_equal(rows, online[entry["request_id"]])
        assert entry["num_tokens"] == 20 + 9 and list(rows.shape) == entry["shape"]


def test_export_makes_no_directory_for_a_namespace_or_dtype_it_refuses(recorded, namespace,
                                                                       tmp_path):
    """Checked before the directory is made: no empty directory is left behind, and a dtype
    that cannot hold the expert IDs is refused before any request is read."""
    url, _ = recorded
    for args in (["--namespace", "no-such-namespace"],
                 ["--namespace", namespace, "--dtype", "bool"],
                 ["--namespace", namespace, "--dtype", "float16"]):
        result = cli("export", url, *args, "--out", str(tmp_path / "out"))
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert not (tmp_path / "out").exists()


def test_export_and_plot_skip_a_request_released_while_they_run(recorded, namespace,
                                                                 tmp_path):
    """A trainer reading beside them releases what it read: a manifest deleted while the
    index still lists it (release deletes the manifest, then its index entry) is skipped,
    said so, and every other request is exported exact."""
    import json

    import numpy as np

    from r3cache import open_store

    url, online = recorded
    store = open_store(url, layout=None, namespace=namespace)
    manifest = store.keys.manifest("req-1")
    assert store.call(manifest, "DEL", manifest) == 1
    store.close()
    result = cli("export", url, "--namespace", namespace, "--out", str(tmp_path / "dir"),
                 "--batch", "2")
    assert result.returncode == 0, result.stderr
    assert "exported 2 request(s)" in result.stdout and "1 released" in result.stdout
    index = json.loads((tmp_path / "dir" / "index.json").read_text())
    assert [r["request_id"] for r in index["requests"]] == ["req-0", "req-2"]
    for entry in index["requests"]:
        np.testing.assert_array_equal(np.load(tmp_path / "dir" / entry["file"]),
                                      online[entry["request_id"]])
    result = cli("plot", url, "--namespace", namespace, "--out", str(tmp_path / "load.png"))
    assert result.returncode == 0, result.stderr
    routings = online["req-0"].size + online["req-2"].size
    assert f"2 requests: {routings} routings" in result.stdout


def test_plot_draws_the_expert_load(recorded, namespace, tmp_path):
    url, online = recorded
    result = cli("plot", url, "--namespace", namespace, "--out", str(tmp_path / "load.png"))
    assert result.returncode == 0, result.stderr
    routings = sum(rows.size for rows in online.values())
    assert f"3 requests: {routings} routings over 4 layers" in result.stdout
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
