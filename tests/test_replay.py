"""Replay of recorded routes into transformers MoE models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3cache.errors import ReplayError
from r3cache.models import tiny_model, tiny_model_names
from r3cache.replay import replay
from r3cache.routers import bind, capturer_for, find_routers

FAMILIES = tiny_model_names()


def forward(model, capturer, ids):
    """Logits and the routes the capturer saw in one forward."""
    with bind(model, capturer), torch.inference_mode():
        logits = model(ids).logits
    return logits, capturer.snapshot(ids.numel()).numpy()


def recorded(name, shape, seed):
    """A tiny model, its capturer, inputs, and the logits and routes of one forward."""
    model = tiny_model(name, num_layers=4, seed=3)
    capturer = capturer_for(model, 128)
    ids = torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))
    return (model, capturer, ids, *forward(model, capturer, ids))


@pytest.mark.parametrize("name", FAMILIES)
def test_replay_reproduces_recorded_routes_and_outputs_exactly(name):
    model, capturer, ids, logits, routes = recorded(name, (2, 24), seed=5)
    with replay(model, routes):
        replayed, seen = forward(model, capturer, ids)
    assert (seen == routes).all()
    assert torch.equal(replayed, logits)  # bitwise: same experts, same weights, same order


@pytest.mark.parametrize("name", FAMILIES)
def test_perturbed_model_follows_recorded_routes_not_its_own(name):
    model, capturer, ids, _, routes = recorded(name, (1, 40), seed=6)
    with torch.no_grad():
        for site in find_routers(model):
            site.module.weight.add_(torch.randn_like(site.module.weight))
    _, own = forward(model, capturer, ids)
    assert (own != routes).any(), "the perturbation must change the model's own choice"
    with replay(model, routes):
        _, seen = forward(model, capturer, ids)
    assert (seen == routes).all()
    # Outside the block the routers choose for themselves again.
    _, after = forward(model, capturer, ids)
    assert (after == own).all()


def test_a_forward_set_on_the_router_instance_is_kept_through_replay():
    """accelerate's device hooks (device_map="auto", offloading) replace a module's forward
    on the instance: replay wraps it, and puts it back at the end rather than dropping it
    and leaving the class's forward, which would skip the hook's weight placement."""
    model, capturer, ids, logits, routes = recorded("qwen3-moe-tiny", (1, 16), seed=8)
    site = find_routers(model)[0]
    calls = []
    original = site.module.forward

    def hooked(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    site.module.forward = hooked
    with replay(model, routes):
        replayed, seen = forward(model, capturer, ids)
    assert (seen == routes).all() and torch.equal(replayed, logits) and calls
    assert site.module.forward is hooked
    before = len(calls)
    forward(model, capturer, ids)
    assert len(calls) == before + 1


def test_replay_with_all_layers_and_gradients():
    model = tiny_model("qwen3-moe-tiny", num_layers=4).train(False)
    capturer = capturer_for(model, 64, layers="all")
    ids = torch.randint(0, 512, (1, 16))
    logits, routes = forward(model, capturer, ids)
    with replay(model, routes, layers="all"):
        out = model(ids).logits  # with autograd, as a trainer runs it
    assert torch.equal(out.detach(), logits)
    out.sum().backward()
    router = find_routers(model)[0].module
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_errors_are_typed():
    model = tiny_model("olmoe-tiny", num_layers=2)
    ids = torch.randint(0, 512, (1, 8))
    bad = {"rows of shape": torch.zeros(8, 3, 4, dtype=torch.long),
           "outside": torch.full((8, 2, 4), 16), "integer": torch.zeros(8, 2, 4),
           # A cast would truncate these into other experts; a top-k never repeats one.
           "float64": np.full((8, 2, 4), 1.5), "twice": torch.zeros(8, 2, 4, dtype=torch.long)}
    for message, routes in bad.items():
        with pytest.raises(ReplayError, match=message), replay(model, routes):
            pass
    routes = torch.arange(4).expand(5, 2, 4)
    with pytest.raises(ReplayError, match="routes 8 tokens"), replay(model, routes):
        model(ids)
    with torch.inference_mode():
        model(ids)  # the failed replay left the model as it was
    assert all("forward" not in site.module.__dict__ for site in find_routers(model))
