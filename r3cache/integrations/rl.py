"""Routes from ``R3Reader`` in the batch conventions of verl, NeMo-RL and slime.

Each converter takes the arrays ``R3Reader.get_many(ids, prompt_start=0)`` returns — one
``(num_tokens - 1, layers, topk)`` array per sequence, rows for positions ``0 .. num_tokens
- 2`` — and is a pure function of them. ``layers`` keeps a subset of the
layer axis (vLLM and SGLang record every decoder layer; a trainer may want MoE layers only).
Errors are ContractError naming the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from r3cache.checks import count, fits_memory, id_range_problem, layer_indices
from r3cache.errors import ContractError


def _checked(routes: Sequence[np.ndarray], layers: Sequence[int] | None, max_id: int,
             target: str) -> list[np.ndarray]:
    """Each sequence's routes, checked before any is converted: integer IDs in
    ``0 .. max_id`` (what ``target`` holds), one (layers, topk) shape for all; then
    ``layers``."""
    if isinstance(routes, (str, bytes, np.ndarray)) or not isinstance(routes, Iterable):
        raise ContractError("routes are a sequence of (tokens, layers, topk) arrays, one per "
                            f"sequence, not {type(routes).__name__}")
    out: list[np.ndarray] = []
    for i, rows in enumerate(routes):
        rows = np.asarray(rows)
        if rows.ndim != 3:
            raise ContractError(f"routes of sequence {i} have shape {rows.shape}, expected "
                                "(tokens, layers, topk)")
        if out and rows.shape[1:] != out[0].shape[1:]:
            raise ContractError(f"sequence {i} has routes of shape {rows.shape[1:]}, the first "
                                f"{out[0].shape[1:]}")
        problem = id_range_problem(rows, max_id)
        if problem:
            raise ContractError(f"routes of sequence {i} {problem} ({target})")
        out.append(rows)
    if layers is None or not out:
        return out
    picked = layer_indices(layers, out[0].shape[1], "the routes'")
    return [rows[:, picked] for rows in out]


def _batch(rows: list[np.ndarray], seq_len: object, dtype: type, fill: int) -> np.ndarray:
    """``[bs, seq_len, layers, topk]`` of ``fill``: a seq_len that no machine pads to (one
    sequence of it past this one's memory) is a ContractError, not numpy's MemoryError."""
    seq_len = count(seq_len, "seq_len")
    row = rows[0].shape[1:] if rows else (0, 0)
    fits_memory(max(len(rows), 1) * seq_len * max(int(np.prod(row)), 1)
                * np.dtype(dtype).itemsize, "seq_len")
    return np.full((len(rows), seq_len, *row), fill, dtype)


def to_verl(routes: Sequence[np.ndarray], seq_len: int, *,
            offsets: Sequence[int] | None = None,
            layers: Sequence[int] | None = None) -> np.ndarray:
    """verl's ``routed_experts`` batch key: int16 ``[bs, seq_len, layers, topk]``.

    verl (0.9, ``actor.megatron.router_replay.mode=R3``) aligns routes with the tokens of
    prompt + response: row ``j`` of sequence ``i`` sits at ``offsets[i] + j`` (the
    sequence's first token, e.g. after verl's left padding of prompts; default 0), and
    the row of the last token, which the inference engine never ran, is padded with 0, as
    are padding positions.
    """
    rows = _checked(routes, layers, np.iinfo(np.int16).max, "verl's int16 routed_experts")
    out = _batch(rows, seq_len, np.int16, 0)
    if offsets is not None and not isinstance(offsets, Iterable):
        raise ContractError(f"offsets are one int per sequence, not {offsets!r:.40}")
    offsets = ([0] * len(rows) if offsets is None else
               [count(at, f"offset {i}") for i, at in enumerate(offsets)])
    if len(offsets) != len(rows):
        raise ContractError(f"{len(offsets)} offsets for {len(rows)} sequences")
    for i, (r, at) in enumerate(zip(rows, offsets)):
        if at + len(r) + 1 > out.shape[1]:
            raise ContractError(f"sequence {i}: {len(r) + 1} tokens at offset {at} do not fit "
                                f"seq_len {out.shape[1]}")
        out[i, at : at + len(r)] = r
    return out


def verl_agent_loop_routes(reader, request_id: str, num_tokens: int, *,
                           layers: Sequence[int] | None = None, wait: float = 5.0) -> np.ndarray:
    """What a verl agent loop sets as ``AgentLoopOutput.routed_experts`` for one rollout:
    the routes of ``request_id`` (its prompt + response, ``num_tokens`` tokens) read from
    r3cache, int16 ``[num_tokens, layers, topk]``, the last row 0. ``wait`` covers the
    moment between the engine's response and its manifest. A rollout recorded without its
    first rows, or of another length, is a ContractError: its rows would sit at other
    tokens' positions."""
    num_tokens = count(num_tokens, "num_tokens", 1)
    rows = reader.get(request_id, wait=wait, prompt_start=0)
    if len(rows) != num_tokens - 1:
        raise ContractError(f"request {request_id!r} has routes of {len(rows) + 1} tokens, "
                            f"the rollout {num_tokens}")
    return to_verl([rows], num_tokens, layers=layers)[0]


def nemo_rl_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed dtype NeMo-RL takes for expert IDs (it uses -1 as a sentinel)."""
    num_experts = count(num_experts, "num_experts", 1)
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ContractError(f"{num_experts} experts do not fit int32")


def to_nemo_rl(routes: Sequence[np.ndarray], num_experts: int, *, seq_len: int | None = None,
               layers: Sequence[int] | None = None) -> np.ndarray | list[np.ndarray]:
    """NeMo-RL's ``routed_experts`` (``policy.router_replay.enabled``).

    One ``[T, layers, topk]`` array per sequence covering all ``T = num_tokens`` tokens
    (``seq_len=None``), or one ``[B, seq_len, layers, topk]`` batch; in the narrowest
    signed dtype for ``num_experts``, with ``-1`` on rows no route covers (each sequence's
    last token, padding).
    """
    dtype = nemo_rl_dtype(num_experts)
    rows = _checked(routes, layers, num_experts - 1, f"a model of {num_experts} experts")
    out = None if seq_len is None else _batch(rows, seq_len, dtype, -1)
    full = []
    for r in rows:
        padded = np.full((len(r) + 1, *r.shape[1:]), -1, dtype)
        padded[: len(r)] = r
        full.append(padded)
    if out is None:
        return full
    for i, f in enumerate(full):
        if len(f) > out.shape[1]:
            raise ContractError(f"sequence {i} has {len(f)} tokens, seq_len is {out.shape[1]}")
        out[i, : len(f)] = f
    return out


def to_slime(rows: np.ndarray, num_tokens: int) -> np.ndarray:
    """slime's ``Sample.rollout_routed_experts``: int32 ``[len(tokens) - 1, layers, topk]``."""
    (rows,) = _checked([rows], None, np.iinfo(np.int32).max, "slime's int32 rows")
    if len(rows) != count(num_tokens, "num_tokens", 1) - 1:
        raise ContractError(f"{len(rows)} rows for a sample of {num_tokens} tokens (slime "
                            f"expects {num_tokens - 1})")
    return rows.astype(np.int32)
