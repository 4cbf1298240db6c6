"""RoutedExpertsCapturer, router binding on transformers MoE families, and the host copy ring."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from r3cache import RoutingLayout, StepBatch, StepMetadata, WorkerConnector, open_store
from r3cache.capture import RoutedExpertsCapturer
from r3cache.errors import CaptureError, InvalidBatchError, LayoutMismatchError
from r3cache.models import tiny_model, tiny_model_names
from r3cache.routers import bind, bind_router, capturer_for, find_routers, router_choices

FAMILIES = tiny_model_names()
REQUIRED = {"mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "olmoe-tiny"}


def test_the_required_families_are_available():
    assert set(FAMILIES) >= REQUIRED


@pytest.mark.parametrize("name", FAMILIES)
def test_captured_ids_are_the_routers_own_topk_in_column_order(name):
    model = tiny_model(name, num_layers=4)
    capturer = capturer_for(model, 64)
    ids = torch.randint(0, 512, (1, 37), generator=torch.Generator().manual_seed(1))
    with bind(model, capturer), torch.inference_mode():
        model(ids)
    rows = capturer.snapshot(37)
    assert rows.dtype == torch.uint8 and rows.shape == (37, len(capturer.moe_layers),
                                                        capturer.layout.topk)
    own = router_choices(model, ids)
    assert sorted(own) == list(capturer.moe_layers)
    for column, layer in enumerate(capturer.moe_layers):
        assert torch.equal(rows[:, column].long(), own[layer]), f"layer {layer}"
    # Routers that order their choice by score keep that order (never sorted by ID).
    assert (np.diff(rows.numpy().astype(int), axis=2) < 0).any()


def test_layers_all_keeps_dense_layers_as_a_documented_filler():
    model = tiny_model("qwen3-moe-tiny", num_layers=4)  # layer 0 is dense
    capturer = capturer_for(model, 32, layers="all")
    assert capturer.moe_layers == (1, 2, 3) and capturer.layout.num_layers == 4
    ids = torch.randint(0, 512, (1, 20))
    with bind(model, capturer), torch.inference_mode():
        model(ids)
    rows = capturer.snapshot(20)
    assert torch.equal(rows[:, 0], torch.arange(4, dtype=torch.uint8).expand(20, 4))
    own = router_choices(model, ids)
    for layer in (1, 2, 3):
        assert torch.equal(rows[:, layer].long(), own[layer])


def test_batched_forward_rows_are_flattened_row_major():
    model = tiny_model("olmoe-tiny", num_layers=2)
    capturer = capturer_for(model, 64)
    ids = torch.randint(0, 512, (3, 9))
    with bind(model, capturer), torch.inference_mode():
        model(ids)
    assert torch.equal(capturer.snapshot(27)[:, 0].long(), router_choices(model, ids)[0])


def test_offsets_and_pause_place_separate_forwards():
    model = tiny_model("mixtral-tiny", num_layers=2)
    capturer = capturer_for(model, 64)
    a, b = torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 7))
    with bind(model, capturer), torch.inference_mode():
        model(a)
        with capturer.at(5):
            model(b)
        before = capturer.snapshot(12)
        with capturer.paused():
            model(torch.randint(0, 512, (1, 12)))
        assert torch.equal(capturer.snapshot(12), before)
    assert torch.equal(before[:5, 1].long(), router_choices(model, a)[1])
    assert torch.equal(before[5:, 1].long(), router_choices(model, b)[1])


def test_custom_router_binds_with_an_index_picker():
    class Router(torch.nn.Module):
        def forward(self, x):
            return {"experts": torch.topk(x, 2).indices}

    layout = RoutingLayout(num_layers=1, topk=2, num_experts=6)
    capturer = RoutedExpertsCapturer(layout, 16, moe_layers=[3], num_model_layers=5)
    router = Router()
    x = torch.randn(4, 6)
    with bind_router(router, 3, capturer, indices=lambda out: out["experts"]):
        router(x)
    assert torch.equal(capturer.snapshot(4)[:, 0].long(), torch.topk(x, 2).indices)
    with pytest.raises(CaptureError, match="not a MoE layer"):
        bind_router(router, 2, capturer)


def test_contract_errors_are_typed():
    layout = RoutingLayout(num_layers=2, topk=2, num_experts=8)
    capturer = RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3])
    with pytest.raises(CaptureError, match="layer 0"):
        capturer.capture(0, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(CaptureError, match="shape"):
        capturer.capture(1, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(CaptureError, match="shape"):
        capturer.capture(1, torch.zeros(2, dtype=torch.long))
    with pytest.raises(CaptureError, match="exceed"):
        capturer.capture(1, torch.zeros(9, 2, dtype=torch.long))
    with pytest.raises(CaptureError, match="snapshot"):
        capturer.snapshot(9)
    # The narrowing copy would truncate them into other experts' IDs.
    with pytest.raises(CaptureError, match="float32"):
        capturer.capture(1, torch.full((2, 2), 1.5))
    with pytest.raises(CaptureError, match="moe_layers"):
        RoutedExpertsCapturer(layout, 8, moe_layers=[1.5, 3])
    with pytest.raises(CaptureError, match="max_num_batched_tokens"):
        RoutedExpertsCapturer(layout, 8.5, moe_layers=[1, 3])
    with pytest.raises(CaptureError, match="layers"):
        RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3], layers="dense")
    with pytest.raises(LayoutMismatchError):
        RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3], layers="all")
    with pytest.raises(CaptureError, match="no MoE router"):
        find_routers(torch.nn.Linear(3, 3))
    other = capturer_for(tiny_model("mixtral-tiny", num_layers=2), 8)
    with pytest.raises(CaptureError):
        bind(tiny_model("olmoe-tiny", num_layers=2), other)



def test_arguments_of_the_wrong_kind_are_capture_errors():
    """Not TypeError or AttributeError from torch: a float count sliced nothing, a numpy
    array has no dim(), an unhashable layer broke the column lookup, None has no modules."""
    layout = RoutingLayout(num_layers=2, topk=2, num_experts=8)
    capturer = RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3])
    ids = torch.zeros(2, 2, dtype=torch.long)
    for call, match in [
        (lambda: capturer.snapshot(1.5), "num_rows must be an int"),
        (lambda: capturer.snapshot("3"), "num_rows must be an int"),
        (lambda: capturer.at(1.5).__enter__(), "row_offset must be an int"),
        (lambda: capturer.host_ring("2"), "depth must be an int"),
        (lambda: capturer.host_ring(2.5), "depth must be an int"),
        (lambda: capturer.host_ring(0), "depth must be >= 1"),
        (lambda: capturer.capture(1, ids.numpy()), "must be a torch.Tensor, not ndarray"),
        (lambda: capturer.capture([1], ids), "not a MoE layer"),
        (lambda: RoutedExpertsCapturer(None, 8, moe_layers=[1, 3]), "must be a RoutingLayout"),
        (lambda: RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3], num_model_layers=4.0),
         "num_model_layers must be an int"),
        (lambda: RoutedExpertsCapturer(layout, 8, moe_layers=[1, 3], device="tpu"),
         "no torch device"),
        (lambda: find_routers(None), "found in a torch.nn.Module"),
        (lambda: bind(tiny_model("mixtral-tiny", num_layers=2), None),
         "captured into a RoutedExpertsCapturer"),
        (lambda: bind_router("router", 1, capturer), "a router to hook is a torch.nn.Module"),
    ]:
        with pytest.raises(CaptureError, match=match):
            call()
    np.testing.assert_array_equal(capturer.snapshot(np.int64(2)).numpy(),
                                  [[[0, 1], [0, 1]]] * 2)  # a numpy int is an int

def worker_with_capturer(capturer, depth):
    store = open_store("memory://", layout=capturer.layout, namespace="capture")
    return WorkerConnector(layout=capturer.layout, store=store, max_num_seqs=4,
                           max_num_batched_tokens=capturer.max_num_batched_tokens,
                           max_concurrent_batches=depth, capturer=capturer)


def test_worker_snapshots_the_capturer_and_outputs_outlive_the_ring():
    layout = RoutingLayout(num_layers=2, topk=2, num_experts=8, block_size=4)
    capturer = RoutedExpertsCapturer(layout, 16, moe_layers=[0, 1])
    worker = worker_with_capturer(capturer, depth=2)
    worker.begin_step(StepMetadata(requests={"r": 0}))
    rng = np.random.default_rng(0)
    expected, received, pendings = [], [], []
    try:
        for step in range(6):
            rows = torch.from_numpy(np.stack([rng.permutation(8)[:2] for _ in range(4)])[:, None]
                                    .repeat(2, axis=1))
            for layer in (0, 1):
                capturer.capture(layer, rows[:, layer])
            expected.append(rows.numpy().astype(np.uint8))
            pending = worker.prepare_output(StepBatch(["r"], np.array([4 * step]),
                                                      np.array([0, 4])))
            pending.enqueue_cpu_copy([1], [0])
            pendings.append(pending)
            if len(pendings) == 2:
                received.append(pendings.pop(0).process_output()["r"].rows)
        received.append(pendings.pop(0).process_output()["r"].rows)
    finally:
        worker.close()
    # Step 0's rows are still intact after its ring slot was reused by steps 2 and 4.
    assert all(np.array_equal(g, e) for g, e in zip(received, expected))


def test_worker_refuses_mismatched_capturers():
    layout = RoutingLayout(num_layers=2, topk=2, num_experts=8)
    capturer = RoutedExpertsCapturer(layout, 8, moe_layers=[0, 1])
    store = open_store("memory://", layout=layout, namespace="capture")
    with pytest.raises(Exception, match="capturer holds 8 rows"):
        WorkerConnector(layout=layout, store=store, max_num_batched_tokens=16, capturer=capturer)
    other = RoutingLayout(num_layers=2, topk=2, num_experts=9)
    with pytest.raises(LayoutMismatchError):
        WorkerConnector(layout=other, store=open_store("memory://", layout=other, namespace="o"),
                        max_num_batched_tokens=8, capturer=capturer)
    worker = worker_with_capturer(capturer, depth=1)
    worker.begin_step(StepMetadata(requests={"r": 0}))
    with pytest.raises(InvalidBatchError, match="max_num_batched_tokens"):
        worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 9])))
    worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; the CUDA path "
                    "(pinned ring, copy stream, events, graphs) runs in scripts/gpu_check.py")
def test_cuda_ring_copy_matches_the_device_rows():
    layout = RoutingLayout(num_layers=2, topk=2, num_experts=8)
    capturer = RoutedExpertsCapturer(layout, 64, moe_layers=[0, 1], device="cuda")
    ids = torch.randint(0, 8, (64, 2), device="cuda")
    capturer.capture(0, ids)
    copy = capturer.host_ring(2).copy(capturer.snapshot(64))
    assert np.array_equal(copy.result()[:, 0], ids.cpu().numpy().astype(np.uint8))


def test_the_gpu_check_passes_on_the_cpu_at_its_defaults():
    """`python scripts/gpu_check.py --device cpu`, as documented: every CPU check passes."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^11/11 checks passed", done.stdout, flags=re.M), done.stdout
    assert "[FAIL]" not in done.stdout
    # The connector runs twice on each writer of the embedded store, putting blocks.
    for writer in ("auto", "thread"):
        runs = re.findall(rf"writer={writer}: .* ([1-9][0-9]*) blocks put", done.stdout)
        assert len(runs) == 2, done.stdout
