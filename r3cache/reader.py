"""R3Reader: offline read-back of finished requests' routes for training jobs."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from r3cache.checks import count, layer_indices, seconds
from r3cache.connector.metadata import generation_suffix
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    CorruptBlockError,
    LayoutMismatchError,
    ManifestNotFoundError,
    R3Error,
)
from r3cache.hashing import DEFAULT_SEED, block_hashes
from r3cache.layout import RoutingLayout
from r3cache.manifest import BlockRef, Manifest, check_request_ids
from r3cache.metrics import SOURCES, ReaderStats
from r3cache.store.base import BlockStore

# Rows fetched per store round in get_many: large enough that a round's fixed cost is
# small, small enough that validating one group overlaps fetching the next.
_GROUP_ROWS = 16384


def _groups(manifests: list[Manifest], rows: int) -> Iterator[list[Manifest]]:
    """Consecutive manifests, about ``rows`` rows a group (a longer request is alone)."""
    group: list[Manifest] = []
    size = 0
    for manifest in manifests:
        if group and size + manifest.completion.num_rows > rows:
            yield group
            group, size = [], 0
        group.append(manifest)
        size += manifest.completion.num_rows
    if group:
        yield group


class _Plan(NamedTuple):
    """One request's rows, the stored blocks that fill them, and the copies after."""

    rows: np.ndarray
    keys: list[str]  # block keys, in the order of ``targets``
    targets: list[np.ndarray]  # where each block's rows are decoded
    copies: list[tuple[int, np.ndarray]]  # (row, rows) placed once the blocks are in

    def finish(self) -> None:
        for start, part in self.copies:
            self.rows[start : start + len(part)] = part


class TokenLookup(NamedTuple):
    """Routes of the longest stored prefix of full blocks of a token sequence."""

    rows: np.ndarray  # (num_rows, layers, topk)
    num_rows: int
    num_blocks: int


class R3Reader:
    """Own a read handle on one namespace: manifests and blocks in, validated rows out.

    ``R3Reader("redis://host:6379/0", namespace="model@v1")`` opens the namespace with
    the layout it stores; it holds nothing and writes nothing but ``release``. The
    engine's R3CACHE_URL will do: its plugin's options (``store_wait``...) are dropped.
    ``layout=`` (the trainer's model) is compared with the stored one: a
    LayoutMismatchError at once rather than routes of another shape. A store object
    (``open_store(...)``) may be passed instead of a URL, without options.
    """

    def __init__(self, source: str | BlockStore, namespace: str | None = None, *,
                 layout: RoutingLayout | None = None, **options: Any) -> None:
        if layout is not None and not isinstance(layout, RoutingLayout):
            raise ContractError(f"layout is a RoutingLayout, not {type(layout).__name__}")
        if isinstance(source, str):
            from r3cache.store import open_store, without_engine_options

            if namespace is None:
                raise ContractError("R3Reader needs the namespace to read")
            given = sorted({"lease", "janitor"} & options.keys())
            if given:  # a reader holds nothing and collects nothing (r3cache gc does)
                raise ContractError(f"R3Reader opens read-only: it takes no "
                                    f"{' or '.join(given)} option")
            # The stored layout, not ``layout``: opening with one writes a namespace
            # that is not there, and a reader writes nothing.
            self.store = open_store(without_engine_options(source), layout=None,
                                    namespace=namespace, lease=False, janitor=False, **options)
            self._owns_store = True
        elif isinstance(source, BlockStore):
            if options or namespace not in (None, source.namespace):
                # Taken silently, they would name a namespace or settings it does not read.
                raise ContractError(
                    f"R3Reader reads the store it is given (namespace "
                    f"{source.namespace!r}); namespace and options go with a URL")
            self.store = source
            self._owns_store = False
        else:
            raise ContractError(f"R3Reader reads a store URL or a BlockStore, not "
                                f"{type(source).__name__}")
        if layout is not None and layout.fingerprint != self.store.layout.fingerprint:
            stored = self.store.layout.fingerprint
            if self._owns_store:
                self.store.close()
            raise LayoutMismatchError(
                f"namespace {self.store.namespace!r} holds routes of layout {stored}, "
                f"not {layout.fingerprint}")
        self.layout: RoutingLayout = self.store.layout
        self.namespace = self.store.namespace
        self.stats = ReaderStats()
        SOURCES.add_reader(self)
        self._pool: ThreadPoolExecutor | None = None  # validates while the next group travels

    # -- numpy ----------------------------------------------------------------------

    def get(self, request_id: str, *, dtype: Any = None,
            layers: Sequence[int] | slice | None = None, wait: float = 0.0,
            prompt_start: int | None = None) -> np.ndarray:
        """Routes of one request: ``(num_tokens - 1 - prompt_start, layers, topk)``."""
        return self.get_many([request_id], dtype=dtype, layers=layers, wait=wait,
                             prompt_start=prompt_start)[0]

    def get_many(self, request_ids: Sequence[str], *, dtype: Any = None,
                 layers: Sequence[int] | slice | None = None,
                 wait: float = 0.0, prompt_start: int | None = None) -> list[np.ndarray]:
        """Routes of many requests: one round for the manifests, then their blocks.

        Rows start where the engine recorded from (a request's ``prompt_start``: 0 unless
        it asked for later rows only, as vLLM's ``routed_experts_prompt_start`` or SGLang's
        ``routed_experts_start_len`` do). ``prompt_start=0`` asks for the rows of every
        position, as replay in training needs them: a request recorded from a later
        position is then a ContractError naming it, never rows that sit where others
        should (any ``prompt_start`` works the same way: rows from that position on).

        Blocks are fetched and decoded in groups of about ``_GROUP_ROWS`` rows, one round
        per node each; while the next group travels, a helper thread validates the
        previous one (numpy releases the GIL), so the checks cost little wall time.
        The first failure, in request order, is raised; nothing partial is returned.
        ``wait`` seconds are given to manifests not there yet: an engine records a
        request's manifest a moment after its response (its next step, then the
        writer), so a trainer reading right after a rollout passes a few seconds.
        """
        request_ids = check_request_ids(request_ids)
        dtype, layers = self._selection(dtype, layers)
        wait = seconds(wait, "wait")
        if prompt_start is not None:
            prompt_start = count(prompt_start, "prompt_start")
        began = time.perf_counter()
        try:
            routes = self._read(request_ids, dtype, layers, wait, prompt_start)
        except R3Error:
            self.stats.failures += 1
            raise
        self.stats.observe(time.perf_counter() - began, len(routes),
                           sum(len(r) for r in routes))
        return routes

    def _read(self, request_ids: list[str], dtype: np.dtype | None, layers: Any,
              wait: float, prompt_start: int | None) -> list[np.ndarray]:
        manifests = self._manifests(request_ids, wait)
        missing = [r for r, m in zip(request_ids, manifests) if m is None]
        if missing:
            raise ManifestNotFoundError(missing, namespace=self.namespace)
        if prompt_start is not None:
            _check_prompt_start(manifests, prompt_start)
        jobs, checks = [], []
        try:
            for group in _groups(manifests, _GROUP_ROWS):
                plans = [self._plan(m) for m in group]
                self._fetch(group, plans)
                for manifest, plan in zip(group, plans):
                    plan.finish()
                    skip = 0 if prompt_start is None else (
                        prompt_start - manifest.completion.prompt_start)
                    jobs.append((manifest, plan.rows, dtype, layers, skip))
                    checks.append(self._checker().submit(self._checked, *jobs[-1]))
            # A check the helper has not started runs here: with every block read, this
            # thread would otherwise wait while the helper works through the last group.
            return [self._checked(*job) if check.cancel() else check.result()
                    for job, check in zip(jobs, checks)]
        finally:
            for check in checks:
                check.cancel()

    def _manifests(self, request_ids: list[str], wait: float) -> list[Manifest | None]:
        manifests = self.store.get_manifests(request_ids)
        deadline = time.monotonic() + wait
        delay = 0.01
        while None in manifests and time.monotonic() < deadline:
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(2 * delay, 0.25)
            absent = [i for i, m in enumerate(manifests) if m is None]
            for i, m in zip(absent, self.store.get_manifests([request_ids[i] for i in absent])):
                manifests[i] = m
        return manifests

    def _selection(self, dtype: Any, layers: Any) -> tuple[np.dtype | None, Any]:
        """``dtype`` and ``layers`` checked against the layout, before anything is read."""
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except TypeError:
                raise ContractError(f"dtype {dtype!r} is not a numpy dtype") from None
            if dtype.kind not in "iu" or np.iinfo(dtype).max < self.layout.num_experts - 1:
                raise ContractError(f"dtype {dtype} cannot hold expert IDs up to "
                                    f"{self.layout.num_experts - 1}")
        if layers is None:
            return dtype, layers
        if isinstance(layers, slice):
            try:
                range(self.layout.num_layers)[layers]
            except (TypeError, ValueError) as exc:  # a bound that is not an int, a step 0
                raise ContractError(f"layers {layers}: {exc}") from None
            return dtype, layers
        return dtype, layer_indices(layers, self.layout.num_layers, "the namespace's")

    def _fetch(self, manifests: list[Manifest], plans: list[_Plan]) -> None:
        """Decode every stored block of ``manifests`` into its place, in one store call."""
        keys = [k for plan in plans for k in plan.keys]
        try:
            self.store.read_into(keys, [t for plan in plans for t in plan.targets])
        except BlockNotFoundError as exc:
            lost = set(exc.keys)
            owners = [m.request_id for m in manifests if lost.intersection(m.block_keys)]
            raise BlockNotFoundError(exc.keys, namespace=self.namespace, request_ids=owners,
                                     cause="a manifest names a block that is gone (evicted "
                                     "or deleted by hand; manifests hold their blocks)") from exc
        except CorruptBlockError as exc:
            owners = [m.request_id for m in manifests if exc.key in m.block_keys]
            raise CorruptBlockError(exc.key, f"{exc.reason} (in the routes of request(s) "
                                    f"{', '.join(map(repr, owners))})") from exc

    def _checked(self, manifest: Manifest, rows: np.ndarray, dtype: Any, layers, skip: int
                 ) -> np.ndarray:
        self._validate(manifest.request_id, rows, manifest.completion.num_rows)
        return _select(rows[skip:], dtype, layers)

    def _checker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="r3cache-reader")
        return self._pool

    def _plan(self, manifest: Manifest) -> _Plan:
        """Where each stored block of ``manifest`` goes: a whole block straight to its place
        in the request's rows, a block slice to a scratch block first; inline rows and
        slices are copied by ``finish``. Runs of whole blocks (a request's usual shape)
        become views in one reshape, not one slice a block.
        """
        bs = self.layout.block_size
        rows = np.empty((manifest.completion.num_rows, *self.layout.row_shape), self.layout.dtype)
        keys: list[str] = []
        targets: list[np.ndarray] = []
        copies: list[tuple[int, np.ndarray]] = []
        at = run = 0  # rows placed so far; where the current run of whole blocks began

        def close_run() -> None:
            if at > run:
                targets.extend(rows[run:at].reshape(-1, *self.layout.block_shape))

        # check_extent already proved the segments cover exactly ``rows``.
        for segment in manifest.segments:
            if segment.__class__ is BlockRef and segment[2] - segment[1] == bs:
                keys.append(segment[0])
                at += bs
                continue
            close_run()
            if segment.__class__ is BlockRef:
                scratch = np.empty(self.layout.block_shape, self.layout.dtype)
                keys.append(segment.key)
                targets.append(scratch)
                copies.append((at, scratch[segment.start : segment.stop]))
            else:
                copies.append((at, segment))
            at += len(copies[-1][1])
            run = at
        close_run()
        return _Plan(rows, keys, targets, copies)

    def _validate(self, request_id: str, rows: np.ndarray, num_rows: int) -> None:
        where = f"routes of request {request_id!r}"
        if rows.shape != (num_rows, *self.layout.row_shape):
            raise CorruptBlockError(where, f"shape {rows.shape}, expected "
                                    f"{(num_rows, *self.layout.row_shape)}")
        problem = self.layout.id_problem(rows)
        if problem:
            raise CorruptBlockError(where, problem)

    # -- torch ----------------------------------------------------------------------

    def get_torch(self, request_id: str, *, dtype: Any = None,
                  layers: Sequence[int] | slice | None = None, device: Any = None,
                  prompt_start: int | None = None):
        """Routes as a torch tensor: int64 by default (Megatron-style gather indices);
        pass ``dtype=torch.int32`` for slime/verl-style replay buffers."""
        return self.get_many_torch([request_id], dtype=dtype, layers=layers, device=device,
                                   prompt_start=prompt_start)[0]

    def get_many_torch(self, request_ids: Sequence[str], *, dtype: Any = None,
                       layers: Sequence[int] | slice | None = None, device: Any = None,
                       prompt_start: int | None = None):
        import torch

        dtype = torch.int64 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise ContractError(f"dtype must be a torch dtype (torch.int64, torch.int32), not "
                                f"{dtype!r:.40}")
        try:
            device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ContractError(f"device {device!r:.40}: {exc}") from None
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise ContractError(f"device {device}: this process has no CUDA device")
        numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
        return [torch.from_numpy(rows).to(device=device)
                for rows in self.get_many(request_ids, dtype=numpy_dtype, layers=layers,
                                          prompt_start=prompt_start)]

    # -- lifecycle and lookups --------------------------------------------------------

    def release(self, *request_ids: str) -> int:
        """Delete these requests' manifests and their holds; the blocks may then expire."""
        return self.store.release_manifests(check_request_ids(request_ids))

    def get_by_tokens(self, token_ids: Sequence[int], *, dtype: Any = None,
                      layers: Sequence[int] | slice | None = None, seed: str = DEFAULT_SEED,
                      extra_keys_per_block: Sequence[tuple | None] | None = None,
                      generation: int = 0) -> TokenLookup:
        """Routes of the longest prefix of ``token_ids`` whose full blocks are all stored.

        Hashes use the namespace's algorithm and ``seed`` (the engine's PYTHONHASHSEED);
        ``generation`` is the engine's prefix-cache generation that stored them (0 until
        its first prefix-cache reset; ``connector.metadata.generation_suffix``).
        """
        dtype, layers = self._selection(dtype, layers)
        suffix = generation_suffix(count(generation, "generation"))
        keys = [h.hex() + suffix for h in block_hashes(
            token_ids, self.layout.block_size, algo=self.store.hash_algo, seed=seed,
            extra_keys_per_block=extra_keys_per_block)]
        while True:  # each miss shortens the prefix: a block evicted since the last read too
            try:
                rows = self.store.get_concatenated(keys)
                break
            except BlockNotFoundError as exc:
                keys = keys[:min(keys.index(k) for k in exc.keys)]
        self._validate("(by tokens)", rows, len(keys) * self.layout.block_size)
        return TokenLookup(_select(rows, dtype, layers), len(rows), len(keys))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> R3Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_prompt_start(manifests: list[Manifest], prompt_start: int) -> None:
    """Every request has rows from ``prompt_start`` on: it was recorded from there or from
    before, and has a token there."""
    for manifest in manifests:
        recorded, num_tokens = manifest.completion
        if recorded > prompt_start:
            raise ContractError(
                f"request {manifest.request_id!r} was recorded from position {recorded} (the "
                f"engine was asked for its later rows only); rows from {prompt_start} were "
                "asked for")
        if prompt_start > max(num_tokens - 1, recorded):
            raise ContractError(f"request {manifest.request_id!r} has {num_tokens} tokens: no "
                                f"rows from position {prompt_start}")


def _select(rows: np.ndarray, dtype: Any, layers: Iterable[int] | slice | None) -> np.ndarray:
    if layers is not None:
        rows = rows[:, layers if isinstance(layers, slice) else list(layers)]
    if dtype is not None and np.dtype(dtype) != rows.dtype:
        rows = rows.astype(dtype)
    return rows
