"""Replay: make a model's routers use recorded routes instead of their own top-k choice.

Inside :func:`replay`, each router's forward runs its own code unchanged, except that the
one top-k call that picks experts (a ``topk`` over the last dimension of a
``(tokens, num_experts)`` score tensor with ``k == top_k``) returns the recorded indices and
the scores gathered at them. Everything after the choice — softmax or sigmoid scoring,
renormalisation, scaling factors, casts — is the model's own code, so routing weights are
computed from the router logits exactly as the model computes them for its own choice.
Group-limited routing (DeepSeek-V3) makes other top-k calls first; their shapes differ and
they run untouched, but only the recorded experts are used.

Requires torch (the ``torch`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from r3cache.capture import LAYER_CHOICES
from r3cache.errors import ReplayError
from r3cache.routers import RouterSite, find_routers, num_model_layers


class _ForcedTopK(TorchFunctionMode):
    """Own one router forward's substitution of its top-k choice by recorded indices."""

    def __init__(self, site: RouterSite, indices: torch.Tensor) -> None:
        super().__init__()
        self.site = site
        self.indices = indices
        self.used = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if (k == self.site.top_k and scores.dim() == 2 and dim in (-1, 1)
                    and scores.shape[1] == self.site.num_experts):
                return self._forced(scores)
        return func(*args, **kwargs)

    def _forced(self, scores: torch.Tensor) -> Any:
        if scores.shape[0] != self.indices.shape[0]:
            raise ReplayError(
                f"layer {self.site.layer_id}: the forward routes {scores.shape[0]} tokens, "
                f"the recorded routes have {self.indices.shape[0]}"
            )
        self.used += 1
        indices = self.indices.to(scores.device)
        return torch.return_types.topk((scores.gather(-1, indices), indices))


def _forced_forward(site: RouterSite, indices: torch.Tensor):
    original = site.module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        mode = _ForcedTopK(site, indices)
        with mode:
            output = original(*args, **kwargs)
        if not mode.used:
            raise ReplayError(
                f"router {site.name!r} made no top-k choice over {site.num_experts} experts "
                "that replay could replace"
            )
        return output

    return forward


def _restore_forward(module: nn.Module, previous: Any) -> None:
    if previous is None:
        module.__dict__.pop("forward", None)  # the class's forward again
    else:
        module.forward = previous


def _as_indices(routes: Any) -> torch.Tensor:
    if isinstance(routes, np.ndarray):
        if routes.size and routes.dtype.kind not in "iu":  # checked before a cast truncates
            raise ReplayError(f"routes must hold integer expert IDs, not {routes.dtype}")
        routes = torch.from_numpy(routes.astype(np.int64, copy=False))
    if not isinstance(routes, torch.Tensor) or routes.dim() != 3:
        raise ReplayError("routes must be a (tokens, num_layers, topk) array or tensor")
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ReplayError(f"routes must hold integer expert IDs, not {routes.dtype}")
    return routes.long()


@contextmanager
def replay(model: nn.Module, routes: Any, *, layers: str = "moe") -> Iterator[None]:
    """Forwards of ``model`` inside this block route every token to its recorded experts.

    ``routes`` is ``(tokens, num_layers, topk)`` in the column order the capturer (and
    ``R3Reader``) use: one column per MoE layer with ``layers="moe"``, per decoder layer with
    ``layers="all"``. A forward over a ``(batch, seq)`` input routes ``batch * seq`` tokens,
    flattened row-major, exactly as the capturer recorded them.
    """
    if layers not in LAYER_CHOICES:
        raise ReplayError(f"layers must be one of {LAYER_CHOICES}, not {layers!r}")
    sites = find_routers(model)
    indices = _as_indices(routes)
    width = len(sites) if layers == "moe" else num_model_layers(model, sites)
    if indices.shape[1:] != (width, sites[0].top_k):
        raise ReplayError(
            f"routes have rows of shape {tuple(indices.shape[1:])}; this model with "
            f"layers={layers!r} needs ({width}, {sites[0].top_k})"
        )
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= sites[0].num_experts):
        raise ReplayError(f"routes hold expert IDs outside [0, {sites[0].num_experts})")
    ordered = indices.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ReplayError("routes name the same expert twice in one (token, layer)")
    device = next(model.parameters()).device
    with ExitStack() as restore:
        for i, site in enumerate(sites):
            column = i if layers == "moe" else site.layer_id
            # A forward set on the instance (accelerate's device hooks) is wrapped and put
            # back afterwards, not dropped with the replay's.
            previous = site.module.__dict__.get("forward")
            site.module.forward = _forced_forward(site, indices[:, column].contiguous().to(device))
            restore.callback(_restore_forward, site.module, previous)
        yield
