"""Megatron-Core router replay fed from r3cache: recorded routes in, the routers' own replay.

Megatron-Core's ``TopKRouter`` (``moe_enable_routing_replay=True``) owns a ``RouterReplay``
that, under ``REPLAY_FORWARD``, uses target indices ``[local_tokens, topk]`` instead of its
own top-k. This module builds those targets from routes read with
``R3Reader.get_many(ids, prompt_start=0)`` — one array ``(num_tokens - 1, layers, topk)``
per sequence, the rows of positions ``0 .. num_tokens - 2`` — in the token order the
router sees:

- sequence-major: hidden states are ``[s, b, h]``, so token ``(position p, sample i)`` is
  row ``p * b + i`` of a padded batch; a packed (THD) batch is the sequences one after the
  other, at offsets ``cu_seqlens``;
- the context-parallel share: with context parallelism a rank holds two of the sequence's
  ``2 * cp_size`` chunks, ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` (Megatron's
  load-balanced split, ``get_batch_on_this_cp_rank``; padded batches);
- the sequence-parallel share of the token axis: with sequence parallelism a tensor-parallel
  rank routes only its ``1 / tp_size`` chunk of the sequence dimension (of its context-
  parallel share);
- the router's layer: ``layers="all"`` when the routes hold every decoder layer (vLLM and
  SGLang capture dense layers too), ``"moe"`` when they hold MoE layers only;
- int64.

Positions the routes do not cover (a sequence's last token, which never ran through the
inference engine, and padding) get the filler ``0 .. topk-1``: valid, distinct experts
whose outputs no loss uses. Every mismatch is a ReplayError naming the sequence, raised
before any target is set.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3cache.checks import count, id_range_problem
from r3cache.errors import ReplayError
from r3cache.layout import repeats_by_columns

# A micro-batch's tokens on one rank: int32 offsets in packed attention (cu_seqlens), and
# past any device's memory for activations in a padded batch.
_MAX_TOKENS = 2**31 - 1


@dataclass
class ReplayBatch:
    """Where a training batch's tokens sit: a padded ``[s, b]`` batch or a packed one.

    Padded: ``seq_len`` (s) with the samples along b. Packed (THD): ``cu_seqlens``, the
    offsets of the sequences in the token axis (padded offsets, where Megatron pads each
    sequence). ``names`` identify the sequences in errors (e.g. their request ids).
    """

    seq_len: int | None = None
    cu_seqlens: Sequence[int] | None = None
    names: Sequence[str] | None = None


def moe_routers(model: Any) -> list[Any]:
    """The model's routers that can replay, in layer order."""
    routers = [m for m in model.modules() if hasattr(m, "router_replay")
               and hasattr(m, "topk") and hasattr(m, "routing")]
    if not routers:
        raise ReplayError("the model has no MoE routers (Megatron-Core TopKRouter)")
    missing = [r for r in routers if r.router_replay is None]
    if missing:
        raise ReplayError("routing replay is off: build the model with "
                          "TransformerConfig(moe_enable_routing_replay=True)")
    if any(getattr(r.config, "moe_router_fusion", False) for r in routers):
        raise ReplayError("moe_router_fusion=True: the fused router ignores replay; turn it "
                          "off for R3")
    return sorted(routers, key=lambda r: getattr(r, "layer_number", 0) or 0)


def replay_targets(routers: Sequence[Any], routes: Sequence[np.ndarray], batch: ReplayBatch,
                   *, layers: str = "all", tp_rank: int | None = None, tp_size: int = 1,
                   cp_rank: int | None = None, cp_size: int = 1) -> list[np.ndarray]:
    """Each router's target indices ``[local_tokens, topk]`` (int64), in ``routers`` order.

    A size above 1 needs this process's rank in it (``tp_rank``, ``cp_rank``): each rank
    routes a share of its own.
    """
    if layers not in ("all", "moe"):
        raise ReplayError(f"layers must be 'all' or 'moe', not {layers!r}")
    tp_rank, tp_size, cp_rank, cp_size = _parallel_share(tp_rank, tp_size, cp_rank, cp_size)
    if (isinstance(routes, (str, bytes)) or not isinstance(routes, (Sequence, np.ndarray))
            or not len(routes)):
        raise ReplayError(f"routes are one array per sequence, at least one; not "
                          f"{routes!r:.40}")
    if isinstance(batch.names, str):  # one name, not a sequence of its letters
        raise ReplayError("ReplayBatch.names is a sequence of names, not a str")
    names = list(batch.names) if batch.names is not None else [f"#{i}" for i in range(len(routes))]
    if len(names) != len(routes):
        raise ReplayError(f"{len(names)} names for {len(routes)} sequences")
    if not routers:
        raise ReplayError("no routers to replay into")
    topk = {int(r.topk) for r in routers}
    if len(topk) != 1:
        raise ReplayError(f"routers disagree on top-k: {sorted(topk)}")
    (k,) = topk
    experts = {int(r.config.num_moe_experts) for r in routers}
    columns = _columns(routers, layers)
    routes = [np.asarray(rows) for rows in routes]
    for name, rows in zip(names, routes):
        if rows.ndim != 3 or rows.shape[2] != k:
            raise ReplayError(f"routes of {name!r} have shape {rows.shape}, expected "
                              f"(tokens, layers, {k})")
        if rows.shape[1] != routes[0].shape[1]:  # one layout: the routes of one namespace
            raise ReplayError(f"routes of {name!r} hold {rows.shape[1]} layers, those of "
                              f"{names[0]!r} {routes[0].shape[1]}")
        if columns and max(columns) >= rows.shape[1]:
            raise ReplayError(f"routes of {name!r} hold {rows.shape[1]} layers; the model's "
                              f"routers need layer {max(columns)} ({layers!r} layers)")
        _check_ids(name, rows, min(experts))
    # (tokens, sequence index, position) sources
    grid = _token_grid(routes, batch, names, cp_rank, cp_size)
    tokens = len(grid[0])
    if tokens % tp_size:
        raise ReplayError(f"{tokens} tokens cannot be split over tp_size={tp_size} "
                          f"(rank {tp_rank})")
    share = slice(tp_rank * tokens // tp_size, (tp_rank + 1) * tokens // tp_size)
    seq_of, pos_of = grid[0][share], grid[1][share]
    covered = seq_of >= 0
    # One gather of every covered token's row, in the stored dtype, then one widening copy
    # into the routers' int64 targets; the filler goes only where no row is recorded.
    flat = np.concatenate(routes)
    starts = np.concatenate(([0], np.cumsum([len(r) for r in routes])[:-1]))
    picked = flat[starts[seq_of[covered]] + pos_of[covered]]
    if columns != list(range(flat.shape[1])):
        picked = picked[:, columns]
    out = np.empty((len(columns), len(seq_of), k), np.int64)
    out[:, ~covered] = np.arange(k)
    out[:, covered] = picked.transpose(1, 0, 2)
    return list(out)


def iter_replay_targets(reader: Any, batches: Sequence[Sequence[str]], routers: Sequence[Any],
                        *, layers: str = "all", tp_rank: int | None = None,
                        tp_size: int = 1, cp_rank: int | None = None, cp_size: int = 1
                        ) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
    """(routes, targets) for each batch of request ids, padded to its longest sequence (its
    rows and last token), rounded up to a multiple of ``tp_size`` and, with context
    parallelism, of ``2 * cp_size``: what Megatron splits evenly across those ranks. The
    next batch is read from the store while this one is converted."""
    from concurrent.futures import ThreadPoolExecutor

    tp_rank, tp_size, cp_rank, cp_size = _parallel_share(tp_rank, tp_size, cp_rank, cp_size)
    batches = list(batches)
    if any(isinstance(names, str) for names in batches):  # one str's letters are strs too
        raise ReplayError("batches are a sequence of batches, each a sequence of request ids")
    empty = [i for i, names in enumerate(batches) if not len(names)]
    if empty:  # checked before any read: a padded batch needs one sequence at least
        raise ReplayError(f"batch {empty[0]} holds no request ids")

    with ThreadPoolExecutor(1, thread_name_prefix="r3cache-megatron") as pool:
        # Rows from position 0: a request recorded from later would replay its rows at
        # other tokens' positions, and is refused by the reader.
        ahead = pool.submit(reader.get_many, batches[0], prompt_start=0) if batches else None
        for at, names in enumerate(batches):
            routes = ahead.result()
            if at + 1 < len(batches):
                ahead = pool.submit(reader.get_many, batches[at + 1], prompt_start=0)
            unit = tp_size * (2 * cp_size if cp_size > 1 else 1)
            seq_len = -(-(max(map(len, routes)) + 1) // unit) * unit
            batch = ReplayBatch(seq_len=seq_len, names=names)
            yield routes, replay_targets(routers, routes, batch, layers=layers,
                                         tp_rank=tp_rank, tp_size=tp_size, cp_rank=cp_rank,
                                         cp_size=cp_size)


def _parallel_share(tp_rank: Any, tp_size: Any, cp_rank: Any, cp_size: Any
                    ) -> tuple[int, int, int, int]:
    """The tensor- and context-parallel ranks and sizes as ints, each rank below its size:
    a float would slice the token axis wrongly, or fail inside numpy. A rank left out is 0
    of a size of 1 only: on every other rank, rank 0's share would replay other tokens'
    experts."""
    tp_size, cp_size = (count(v, n, 1, ReplayError) for v, n in ((tp_size, "tp_size"),
                                                                  (cp_size, "cp_size")))
    for rank, size, name in ((tp_rank, tp_size, "tp"), (cp_rank, cp_size, "cp")):
        if rank is None and size > 1:
            raise ReplayError(f"{name}_size={size} needs {name}_rank, this process's rank "
                              f"(each rank routes its own share of the tokens)")
    tp_rank, cp_rank = (count(0 if v is None else v, n, 0, ReplayError)
                        for v, n in ((tp_rank, "tp_rank"), (cp_rank, "cp_rank")))
    if tp_rank >= tp_size:
        raise ReplayError(f"tensor-parallel rank {tp_rank} of tp_size={tp_size}")
    if cp_rank >= cp_size:
        raise ReplayError(f"context-parallel rank {cp_rank} of cp_size={cp_size}")
    return tp_rank, tp_size, cp_rank, cp_size


def _check_ids(name: str, rows: np.ndarray, num_experts: int) -> None:
    """Rows a router could have picked: integer IDs below ``num_experts`` (one out of range
    indexes past the router's experts on the device), none twice in one (token, layer)."""
    problem = id_range_problem(rows, num_experts - 1)
    if problem:
        raise ReplayError(f"routes of {name!r} {problem} (the model's routers have "
                          f"{num_experts} experts)")
    if rows.size and repeats_by_columns(rows):
        raise ReplayError(f"routes of {name!r} name the same expert twice in one row")


def _columns(routers: Sequence[Any], layers: str) -> list[int]:
    """The routes' layer each router replays: its decoder layer (``layer_number``, global
    across pipeline stages), or with ``"moe"`` its place among the model's MoE layers.

    One pipeline stage holds every router, in order. Under pipeline parallelism a stage
    holds only some (not one run of them, with virtual stages), so each router's place
    is counted from the model's MoE layer pattern (``moe_layer_freq``) up to its layer.
    """
    numbers = [getattr(r, "layer_number", None) for r in routers]
    known = all(isinstance(n, int) and n >= 1 for n in numbers)
    config = routers[0].config
    staged = (getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1
    if layers == "moe" and not staged:
        return list(range(len(routers)))
    if not known:
        raise ReplayError("a router has no layer_number; " + (
            "with pipeline parallelism each stage's routers need it to find their layers"
            if staged else "pass layers='moe' to map routers to the routes' layers in order"))
    if layers == "all":
        return [n - 1 for n in numbers]
    pattern = _moe_layer_pattern(config)
    beyond = [n for n in numbers if n > len(pattern) or not pattern[n - 1]]
    if beyond:
        raise ReplayError(f"decoder layer {beyond[0]} has a router, but the model's MoE layer "
                          f"pattern (moe_layer_freq) does not make it an MoE layer")
    starts = np.concatenate(([0], np.cumsum(pattern)))
    return [int(starts[n - 1]) for n in numbers]


def _moe_layer_pattern(config: Any) -> list[int]:
    """1 for each decoder layer that is an MoE layer, as Megatron-Core's GPT layer specs
    read ``moe_layer_freq``: every k-th layer from the first, or an explicit list."""
    freq, num_layers = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)]
    return [int(bool(x)) for x in freq]


def _token_grid(routes: Sequence[np.ndarray], batch: ReplayBatch, names: list[str],
                cp_rank: int = 0, cp_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """For every token of the router's (sequence-major) axis on this context-parallel rank:
    its sequence and position in the routes, or -1 where no recorded row covers it."""
    n = len(routes)
    lengths = [len(r) for r in routes]
    if (batch.seq_len is None) == (batch.cu_seqlens is None):
        raise ReplayError("give ReplayBatch either seq_len (padded [s, b]) or cu_seqlens "
                          "(packed THD)")
    if batch.seq_len is not None:
        s = count(batch.seq_len, "seq_len", 1, ReplayError)
        if s * n > _MAX_TOKENS:  # a typo, refused before its grid is allocated
            raise ReplayError(f"seq_len={s} for {n} sequences is {s * n} tokens, past "
                              f"{_MAX_TOKENS}")
        for name, length in zip(names, lengths):
            if length > s - 1:
                raise ReplayError(f"routes of {name!r} cover {length} tokens; a sequence of "
                                  f"{s} positions holds at most {s - 1} recorded rows")
        positions = np.arange(s)
        if cp_size > 1:
            if s % (2 * cp_size):
                raise ReplayError(f"seq_len={s} does not split into 2 * cp_size = "
                                  f"{2 * cp_size} equal chunks")
            chunks = positions.reshape(2 * cp_size, -1)
            positions = np.concatenate((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]))
        position = np.repeat(positions, n)  # token p * b + i
        sequence = np.tile(np.arange(n), len(positions))
    else:
        if cp_size > 1:  # each sequence split by Transformer Engine: not reproduced here
            raise ReplayError("context parallelism is replayed for padded batches (seq_len); "
                              "a packed (THD) batch splits each sequence across ranks")
        offsets = np.asarray(batch.cu_seqlens)
        if offsets.ndim != 1 or (offsets.size and offsets.dtype.kind not in "iu"):
            raise ReplayError(f"cu_seqlens must be a flat sequence of ints, not "
                              f"{batch.cu_seqlens!r:.80}")
        # Compared as Python ints: a uint64 past int64 would wrap, and its spans with it.
        given = offsets.tolist()
        if len(given) != n + 1 or given[0] != 0 or any(map(operator.gt, given, given[1:])):
            raise ReplayError(f"cu_seqlens must be {n + 1} non-decreasing offsets from 0, "
                              f"got {given!r:.80}")
        if given[-1] > _MAX_TOKENS:  # a typo, refused before its grid is allocated
            raise ReplayError(f"cu_seqlens ends at {given[-1]} tokens, past "
                              f"{_MAX_TOKENS} (int32 offsets)")
        offsets = offsets.astype(np.int64)
        spans = np.diff(offsets)
        for name, length, span in zip(names, lengths, spans):
            if length > span - 1:
                raise ReplayError(f"routes of {name!r} cover {length} tokens; its packed "
                                  f"span of {span} holds at most {span - 1}")
        sequence = np.repeat(np.arange(n), spans)
        position = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], spans)
    covered = position < np.asarray(lengths)[sequence]
    return np.where(covered, sequence, -1), position


@dataclass
class Replay:
    """Own the replay set on a model's routers while a ``router_replay`` block runs."""

    routers: list[Any]

    def recompute(self) -> None:
        """Before a backward pass that recomputes the forward (activation checkpointing):
        the recompute takes the same targets again, in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


@contextmanager
def router_replay(model: Any, routes: Sequence[np.ndarray], batch: ReplayBatch, *,
                  layers: str = "all", tp_rank: int | None = None,
                  tp_size: int | None = None, cp_rank: int | None = None,
                  cp_size: int | None = None, device: Any = None) -> Iterator[Replay]:
    """Force the model's routers onto ``routes`` for the forward passes inside the block.

    ``tp_rank`` / ``tp_size`` default to Megatron's tensor-parallel group where the
    routers' config has ``sequence_parallel``, else the whole token axis; ``cp_rank`` /
    ``cp_size`` to its context-parallel group where ``context_parallel_size`` > 1.
    Targets and actions are cleared on exit, also on error.
    """
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    for rank, size, name in ((tp_rank, tp_size, "tp"), (cp_rank, cp_size, "cp")):
        if size is None and rank is not None:  # Megatron's group would override it
            raise ReplayError(f"{name}_rank={rank!r:.20} needs {name}_size with it")
    if tp_size is None:
        tp_rank, tp_size = _sequence_parallel_share(routers[0].config)
    if cp_size is None:
        cp_rank, cp_size = _context_parallel_share(routers[0].config)
    targets = replay_targets(routers, routes, batch, layers=layers, tp_rank=tp_rank,
                             tp_size=tp_size, cp_rank=cp_rank, cp_size=cp_size)
    try:
        for router, target in zip(routers, targets):
            router.router_replay.set_target_indices(torch.from_numpy(target).to(device))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield Replay(routers)
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def _sequence_parallel_share(config: Any) -> tuple[int, int]:
    if not getattr(config, "sequence_parallel", False):
        return 0, 1
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _context_parallel_share(config: Any) -> tuple[int, int]:
    if (getattr(config, "context_parallel_size", 1) or 1) <= 1:
        return 0, 1
    from megatron.core import parallel_state

    return (parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size())
