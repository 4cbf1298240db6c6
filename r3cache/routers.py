"""Finding the routers of torch MoE models and hooking them to a capturer.

Hugging Face transformers (v5) gives every MoE family a router module (``MixtralTopKRouter``,
``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``, …) with ``top_k`` and
``num_experts`` attributes whose forward returns ``(router_logits, routing_weights,
expert_indices)``. :func:`find_routers` finds them by that class-name convention and reads
the decoder layer from the module path (``model.layers.<i>.mlp.gate``). Any other module
that picks experts is bound with :func:`bind_router` and a function that picks the
``(tokens, topk)`` index tensor out of its output.

Requires torch (the ``torch`` extra).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from r3cache.capture import LAYER_CHOICES, RoutedExpertsCapturer
from r3cache.errors import CaptureError
from r3cache.layout import RoutingLayout

_ROUTER_CLASS = re.compile(r"top_?k_?router$", re.IGNORECASE)
_LAYER_PATH = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def default_indices(output: Any) -> torch.Tensor:
    """The expert indices of a transformers router's ``(logits, weights, indices)`` output."""
    return output[2]


@dataclass(frozen=True)
class RouterSite:
    """One router of a model: where it sits and what it chooses among."""

    layer_id: int
    name: str
    module: nn.Module
    num_experts: int
    top_k: int


def find_routers(model: nn.Module) -> list[RouterSite]:
    """Every transformers-style router of ``model``, ordered by decoder layer."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"routers are found in a torch.nn.Module, not {model!r:.40}")
    sites = []
    for name, module in model.named_modules():
        if not _ROUTER_CLASS.search(type(module).__name__):
            continue
        match = _LAYER_PATH.search(name + ".")
        if match is None:
            raise CaptureError(f"router {name!r} is not under a numbered decoder layer")
        sites.append(RouterSite(int(match.group(1)), name, module,
                                int(module.num_experts), int(module.top_k)))
    if not sites:
        raise CaptureError(
            f"no MoE router found in {type(model).__name__}; bind custom routers with "
            "r3cache.routers.bind_router(module, layer_id, capturer, indices=...)"
        )
    sites.sort(key=lambda s: s.layer_id)
    layer_ids = [s.layer_id for s in sites]
    if len(set(layer_ids)) != len(layer_ids):
        raise CaptureError(f"more than one router per decoder layer: {layer_ids}")
    shapes = {(s.num_experts, s.top_k) for s in sites}
    if len(shapes) != 1:
        raise CaptureError(f"routers disagree on (num_experts, top_k): {sorted(shapes)}")
    return sites


def num_model_layers(model: nn.Module, sites: list[RouterSite]) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    return int(getattr(text, "num_hidden_layers", sites[-1].layer_id + 1))


def model_layout(model: nn.Module, *, layers: str = "moe", block_size: int = 16) -> RoutingLayout:
    """The RoutingLayout of ``model``'s routes: one column per MoE (or every) layer."""
    if layers not in LAYER_CHOICES:
        raise CaptureError(f"layers must be one of {LAYER_CHOICES}, not {layers!r}")
    sites = find_routers(model)
    width = len(sites) if layers == "moe" else num_model_layers(model, sites)
    return RoutingLayout(width, sites[0].top_k, sites[0].num_experts, block_size)


def capturer_for(
    model: nn.Module,
    max_num_batched_tokens: int,
    *,
    layers: str = "moe",
    block_size: int = 16,
    device: str | torch.device | None = None,
) -> RoutedExpertsCapturer:
    """A capturer shaped for ``model`` (on its device unless told), not yet bound."""
    sites = find_routers(model)
    if device is None:
        device = next(model.parameters()).device
    return RoutedExpertsCapturer(
        model_layout(model, layers=layers, block_size=block_size),
        max_num_batched_tokens,
        moe_layers=[s.layer_id for s in sites],
        num_model_layers=num_model_layers(model, sites),
        layers=layers,
        device=device,
    )


class Binding:
    """Own the forward hooks that feed one capturer; ``remove()`` (or ``with``) unhooks."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> Binding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _check_capturer(capturer: Any) -> None:
    if not isinstance(capturer, RoutedExpertsCapturer):
        raise CaptureError(f"routes are captured into a RoutedExpertsCapturer, not "
                           f"{capturer!r:.40}")


def bind_router(
    module: nn.Module,
    layer_id: int,
    capturer: RoutedExpertsCapturer,
    *,
    indices: Callable[[Any], torch.Tensor] = default_indices,
    binding: Binding | None = None,
) -> Binding:
    """Hook any module that chooses experts: after each forward, ``indices(output)`` (a
    ``(tokens, topk)`` tensor in the router's column order) is captured as ``layer_id``."""
    if not isinstance(module, nn.Module):
        raise CaptureError(f"a router to hook is a torch.nn.Module, not {module!r:.40}")
    _check_capturer(capturer)
    capturer.column(layer_id)  # a wrong layer fails here, not inside the first forward

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        capturer.capture(layer_id, indices(output))

    binding = binding or Binding()
    binding._handles.append(module.register_forward_hook(hook))
    return binding


def bind(model: nn.Module, capturer: RoutedExpertsCapturer) -> Binding:
    """Hook every router of ``model`` (see :func:`find_routers`) to ``capturer``."""
    _check_capturer(capturer)
    sites = find_routers(model)
    found = tuple(s.layer_id for s in sites)
    if found != capturer.moe_layers:
        raise CaptureError(f"model MoE layers {list(found)} != capturer's "
                           f"{list(capturer.moe_layers)}")
    if (sites[0].top_k, sites[0].num_experts) != (capturer.layout.topk,
                                                  capturer.layout.num_experts):
        raise CaptureError("the model's top_k / num_experts differ from the capturer's layout")
    binding = Binding()
    for site in sites:
        bind_router(site.module, site.layer_id, capturer, binding=binding)
    return binding


def router_choices(model: nn.Module, *args: Any, **kwargs: Any) -> dict[int, torch.Tensor]:
    """Run ``model(*args, **kwargs)`` once and return each router's own expert indices by
    decoder layer, read straight off the router outputs (a reference for any capturer)."""
    seen: dict[int, torch.Tensor] = {}
    handles = [site.module.register_forward_hook(
        lambda _m, _a, out, layer=site.layer_id: seen.__setitem__(layer, out[2].clone()))
        for site in find_routers(model)]
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen
