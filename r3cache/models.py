"""Tiny, randomly initialised transformers MoE models, and the runner that feeds the simulator.

:func:`tiny_model` builds one model per supported family from a small config (no download).
:class:`ModelRoutes` plays the model runner inside :mod:`r3cache.sim`: each step it runs the
scheduled chunks through the model with per-request KV caches, and the router hooks write
the routes into the worker's :class:`~r3cache.capture.RoutedExpertsCapturer` at the chunk's
batch rows. Its oracle is a fresh full forward of each request.

Requires torch and transformers >= 5 (the ``models`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn

from r3cache.capture import RoutedExpertsCapturer
from r3cache.errors import CaptureError
from r3cache.layout import RoutingLayout
from r3cache.routers import bind, capturer_for

_COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               attn_implementation="eager", experts_implementation="eager")

# name -> (config class, model class, family-specific settings). Layer 0 is dense where the
# family allows dense layers, so "all" vs "moe" layer selection is exercised.
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral-tiny": ("MixtralConfig", "MixtralForCausalLM",
                     dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe-tiny": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                       dict(intermediate_size=64, moe_intermediate_size=32, num_experts=16,
                            num_experts_per_tok=4, shared_expert_intermediate_size=64,
                            mlp_only_layers=[0])),
    "qwen3-moe-tiny": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(intermediate_size=64, moe_intermediate_size=32, num_experts=16,
                            num_experts_per_tok=4, head_dim=16, mlp_only_layers=[0])),
    "olmoe-tiny": ("OlmoeConfig", "OlmoeForCausalLM",
                   dict(intermediate_size=32, num_experts=16, num_experts_per_tok=4)),
    "deepseek-v3-tiny": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                         dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=16,
                              num_experts_per_tok=4, n_group=4, topk_group=2,
                              first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16,
                              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=16, num_key_value_heads=4)),
    "gpt-oss-tiny": ("GptOssConfig", "GptOssForCausalLM",
                     dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                          head_dim=16, sliding_window=4096)),
}


def tiny_model_names() -> list[str]:
    """Families the installed transformers has, as ``<family>-tiny`` names."""
    return [name for name, (config, _, _) in _FAMILIES.items() if hasattr(transformers, config)]


def tiny_model(name: str, *, num_layers: int = 4, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> nn.Module:
    """A randomly initialised ``name`` model in eval mode; float64 by default, so a KV-cached
    forward and a full forward pick the same experts unless two scores truly tie."""
    if name not in tiny_model_names():
        raise CaptureError(f"unknown or unavailable model {name!r}; choose from "
                           f"{tiny_model_names()} (transformers {transformers.__version__})")
    config_name, model_name, settings = _FAMILIES[name]
    config = getattr(transformers, config_name)(num_hidden_layers=num_layers,
                                                **{**_COMMON, **settings})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(dtype).eval()


class ModelRoutes:
    """Own a model's forwards for the simulator: per-request KV caches and capture offsets.

    A chunk of positions ``[start, start + count)`` first brings the request's cache to
    ``start`` (cropping what rejected drafts or a preemption left, or refilling with capture
    paused what a prefix-cache hit skipped), then runs with the capturer writing at the
    chunk's batch rows, then keeps only the accepted positions in the cache.
    """

    exact = False  # a model need not be batch-invariant: differences are counted, not failed

    def __init__(self, model: nn.Module, max_num_batched_tokens: int, *, layers: str = "moe",
                 block_size: int = 16) -> None:
        self.model = model
        self.capturer: RoutedExpertsCapturer = capturer_for(
            model, max_num_batched_tokens, layers=layers, block_size=block_size)
        self.layout: RoutingLayout = self.capturer.layout
        self.binding = bind(model, self.capturer)
        self.vocab_size = int(model.config.vocab_size)
        self._device = next(model.parameters()).device
        self._caches: dict[str, tuple[Any, int]] = {}

    def expected(self, req_id: str, tokens: Sequence[int]) -> np.ndarray:
        """Routes of every position from one fresh, uncached forward over ``tokens``."""
        capturer = RoutedExpertsCapturer(
            self.layout, max(len(tokens), 1), moe_layers=self.capturer.moe_layers,
            num_model_layers=self.capturer.num_model_layers, layers=self.capturer.layers,
            device=self._device)
        with bind(self.model, capturer), self.capturer.paused():
            self._forward(tokens, None, 0)
        return capturer.snapshot(len(tokens)).cpu().numpy()

    def run(self, chunks: Sequence[Any], qsl: np.ndarray, padding: int) -> None:
        """Run one step's chunks; the rows land in the capturer (the worker snapshots it).

        ``padding`` (rows the oracle appends past the batch) has no meaning here: the
        worker snapshots exactly the batch's rows.
        """
        for chunk, row in zip(chunks, qsl[:-1].tolist()):
            cache, length = self._caches.get(chunk.req_id) or (self._new_cache(), 0)
            if length > chunk.start:
                cache.crop(chunk.start - length)  # negative: tokens to drop from the end
            elif length < chunk.start:
                with self.capturer.paused():
                    self._forward(chunk.tokens[length : chunk.start], cache, length)
            ids = list(chunk.tokens[chunk.start : chunk.start + chunk.count])
            ids += [0] * (chunk.count - len(ids))  # positions past the end (dropped rows)
            with self.capturer.at(row):
                self._forward(ids, cache, chunk.start)
            if chunk.keep < chunk.count:
                cache.crop(chunk.keep - chunk.count)
            self._caches[chunk.req_id] = (cache, chunk.start + chunk.keep)

    def forget(self, req_id: str) -> None:
        self._caches.pop(req_id, None)

    def close(self) -> None:
        self.binding.remove()
        self._caches.clear()

    def _new_cache(self) -> Any:
        return transformers.DynamicCache(config=self.model.config)

    def _forward(self, ids: Sequence[int], cache: Any, start: int) -> None:
        if not len(ids):
            return
        if max(ids) >= self.vocab_size:
            raise CaptureError(f"token {max(ids)} is outside the model's vocabulary "
                               f"({self.vocab_size})")
        tensor = torch.tensor([list(ids)], device=self._device)
        positions = torch.arange(start, start + len(ids), device=self._device)[None]
        with torch.inference_mode():
            self.model(input_ids=tensor, position_ids=positions, cache=cache,
                       use_cache=cache is not None)

