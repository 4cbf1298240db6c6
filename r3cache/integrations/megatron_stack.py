"""A tiny Megatron-Core MoE stack on the CPU: real TopKRouters, for tests and the trainer script.

Megatron needs its parallel state even on one process (``process_groups`` starts a gloo
group of one). ``TopKRouter.gating`` moves its weight to CUDA, so the stack applies the
gating weight itself and calls the router's own ``routing`` — scores, top-k, and the
replay of recorded indices are Megatron's.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np


def process_groups(port: int):
    """Megatron's process groups on a single gloo process (tensor parallel size 1)."""
    import torch

    with warnings.catch_warnings():  # no Transformer Engine or Apex here: torch fallbacks
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return ProcessGroupCollection.use_mpu_process_groups()


def moe_stack(groups, *, num_layers: int, moe_layers: Sequence[int], hidden: int,
              experts: int, topk: int, seed: int = 0, **config):
    """Decoder layers ``1 .. num_layers``; those in ``moe_layers`` route with a TopKRouter.

    Calling the stack on hidden states ``[s, b, h]`` returns each router's routing map
    ``[s * b, experts]``, in layer order.
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.config = TransformerConfig(
                    num_layers=num_layers, hidden_size=hidden, num_attention_heads=4,
                    num_moe_experts=experts, moe_router_topk=topk,
                    moe_enable_routing_replay=True, use_cpu_initialization=True,
                    moe_router_load_balancing_type="none", add_bias_linear=False, **config)
            self.layers = torch.nn.ModuleList()
            for number in range(1, num_layers + 1):
                if number in moe_layers:
                    layer = TopKRouter(config=self.config, pg_collection=groups)
                    layer.set_layer_number(number)
                else:
                    layer = torch.nn.Linear(hidden, hidden)
                self.layers.append(layer)

        @property
        def routers(self) -> list:
            return [layer for layer in self.layers if isinstance(layer, TopKRouter)]

        def forward(self, states):
            maps = []
            for layer in self.layers:
                if isinstance(layer, TopKRouter):
                    _, routing_map = layer.routing(states @ layer.weight.t())
                    maps.append(routing_map)
                states = torch.tanh(states + (0 if isinstance(layer, TopKRouter)
                                              else layer(states)))
            return maps

    return Stack()


def chosen(routing_map) -> np.ndarray:
    """The experts each token was routed to, sorted: ``[tokens, topk]``."""
    tokens, experts = routing_map.shape
    return np.nonzero(routing_map.numpy())[1].reshape(tokens, -1)
