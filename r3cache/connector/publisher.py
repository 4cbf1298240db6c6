"""RequestPublisher: a finished request's routes, handed over whole, into the store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from r3cache.checks import count, is_int, seconds
from r3cache.connector.worker import WorkerStats
from r3cache.errors import ContractError, InvalidBatchError, R3Error
from r3cache.hashing import DEFAULT_SEED, block_hashes, token_id_array
from r3cache.layout import RoutingLayout, repeats_an_expert
from r3cache.manifest import BlockSpan, Completion, Manifest, check_request_id
from r3cache.metrics import SOURCES
from r3cache.store.base import BlockStore, check_layout_and_store
from r3cache.store.writers import choose_writer
from r3cache.store.writers.background import BackgroundBlockStore
from r3cache.store.writers.process import spawn_writer


class RequestPublisher:
    """Own the publication of finished requests whose rows an engine hands over whole.

    For an engine that has no KV block hashes where it hands routes out (SGLang gives a
    request's rows ``[prompt_start, num_tokens - 1)`` when it finishes). Each full block of
    rows is keyed by r3cache's hash chain over the request's token ids (``r3cache.hashing``,
    the namespace's algorithm): a block's rows depend on exactly the tokens up to its end,
    so requests and replicas that share a prefix share its blocks, and
    ``R3Reader.get_by_tokens`` finds them. The partial blocks at either end ride inline in
    the manifest, recorded under the request id.

    ``publish`` checks and copies the rows, then hands them to a helper process (Redis) or
    a writer thread, waiting at most ``store_wait`` seconds for room; the embedded store
    is written in place unless ``writer="thread"``.
    """

    def __init__(
        self,
        *,
        layout: RoutingLayout,
        store: BlockStore,
        seed: str = DEFAULT_SEED,
        writer: str = "auto",
        store_wait: float = 10.0,
        on_unavailable: str = "raise",
        max_pending: int = 256,
    ) -> None:
        check_layout_and_store(layout, store, "publisher")
        if not isinstance(seed, str):
            raise ContractError(f"the hash seed must be a str, not {seed!r:.40}")
        store_wait = seconds(store_wait, "store_wait")
        max_pending = count(max_pending, "max_pending", 1)  # 0 would make the queue unbounded
        writer = choose_writer(store, writer, on_unavailable)
        if writer == "inline":
            pass  # the embedded store, written in place (choose_writer says why)
        elif writer == "process":
            store = spawn_writer(store, max_pending=max_pending, max_wait=store_wait)
        else:
            store = BackgroundBlockStore(store, max_pending=max_pending, max_wait=store_wait,
                                         on_unavailable=on_unavailable)
        self.layout = layout
        layout.prepare_checks()
        self.store = store
        self.seed = seed
        self.stats = WorkerStats()
        SOURCES.add_engine(self)  # read at scrape time: publishing pays nothing

    def publish(self, request_id: str, token_ids: Sequence[int], rows: Any,
                prompt_start: int = 0, extra_keys: tuple | None = None) -> Manifest:
        """Store the routes of a finished request and record its manifest.

        ``rows``: integer array ``(len(token_ids) - 1 - prompt_start, num_layers, topk)``,
        the routes of positions ``prompt_start ..``; any integer dtype whose values are
        expert IDs. ``extra_keys`` (a LoRA adapter's name, say) enters every block's hash:
        routes of the same tokens under other weights are other blocks. Everything is
        checked before anything is written.
        """
        check_request_id(request_id)
        try:
            tokens = token_id_array(token_ids)
        except ContractError as exc:
            raise InvalidBatchError(f"request {request_id!r}: {exc}") from None
        if not is_int(prompt_start) or not 0 <= prompt_start <= max(len(tokens) - 1, 0):
            raise InvalidBatchError(
                f"request {request_id!r}: prompt_start must be an int in 0..{len(tokens) - 1}, "
                f"not {prompt_start!r}")
        if extra_keys is not None and not isinstance(extra_keys, tuple):
            raise InvalidBatchError(f"request {request_id!r}: extra_keys must be a tuple or "
                                    f"None, not {extra_keys!r:.80}")
        completion = Completion(int(prompt_start), len(tokens))
        owned = self._owned_rows(request_id, rows, completion.num_rows)
        bs = self.layout.block_size
        lo, hi = completion.prompt_start, len(tokens) - 1
        whole = max(hi, 0) // bs  # blocks whose every row was computed
        first = min(-(-lo // bs), whole)  # the first of them at or after prompt_start
        keys = [h.hex() for h in block_hashes(
            tokens[: whole * bs], bs, algo=self.store.hash_algo, seed=self.seed,
            extra_keys_per_block=[extra_keys] * whole if extra_keys is not None else None)]
        keys = keys[first:]
        objects = {key: owned[i * bs - lo : (i + 1) * bs - lo]
                   for i, key in enumerate(keys, first)}
        head = [owned[: first * bs - lo]] if first * bs > lo else []
        tail_from = max(whole * bs, lo)
        tail = [owned[tail_from - lo :]] if tail_from < hi else []
        manifest = Manifest(request_id, self.layout.fingerprint, completion,
                            BlockSpan(head, keys, tail, bs))
        try:
            # Pinned before they are written, held by the manifest, then let go by this
            # publisher: the blocks are never unheld between the write and the record.
            self.store.put(objects, keys, keys[::-1], [manifest])
        except R3Error as exc:
            self.stats.errors[type(exc).__name__] += 1
            raise
        self.stats.rows_captured += len(owned)
        self.stats.blocks_published += len(objects)
        self.stats.manifests += 1
        return manifest

    def _owned_rows(self, request_id: str, rows: Any, num_rows: int) -> np.ndarray:
        """``rows`` as a fresh array in the layout's dtype, once every ID is checked."""
        layout = self.layout
        array = np.asarray(rows)
        if array.dtype.kind not in "iu":
            raise InvalidBatchError(f"request {request_id!r}: rows must hold integers, not "
                                    f"{array.dtype}")
        if array.shape != (num_rows, *layout.row_shape):
            raise InvalidBatchError(
                f"request {request_id!r}: rows have shape {array.shape}, expected "
                f"({num_rows}, {layout.num_layers}, {layout.topk})")
        # The range is checked in the engine's dtype, so the cast below cannot wrap.
        if array.size and (int(array.min()) < 0 or int(array.max()) >= layout.num_experts):
            raise InvalidBatchError(f"request {request_id!r}: expert IDs outside "
                                    f"0..{layout.num_experts - 1}")
        owned = np.array(array, dtype=layout.dtype, order="C", copy=True)
        if repeats_an_expert(owned):  # the range is checked above, not again here
            raise InvalidBatchError(f"request {request_id!r}: a row names the same "
                                    "expert twice")
        return owned

    def flush(self) -> None:
        """Return once every earlier publish is written (or raise its error)."""
        self.store.flush()

    def close(self) -> None:
        """Write what is pending and let the store go."""
        self.store.close()

