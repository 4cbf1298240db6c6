"""Capture: router hooks write expert IDs into a static device buffer; steps reach the host async.

Data flow: a router hook calls :meth:`RoutedExpertsCapturer.capture` once per MoE layer and
forward; the worker connector takes :meth:`~RoutedExpertsCapturer.snapshot` on the compute
stream right after the forward, and a :class:`HostCopyRing` copies that snapshot into pinned
host memory on a side stream while the GPU runs the next step. Nothing here synchronises the
host with the device except :meth:`HostCopy.result`, which waits on one event.

Requires torch (the ``torch`` extra).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from r3cache.checks import count
from r3cache.errors import CaptureError, LayoutMismatchError
from r3cache.layout import RoutingLayout

LAYER_CHOICES = ("moe", "all")


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a layout's storage dtype (uint8, uint16 or int32)."""
    return {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16,
            np.dtype(np.int32): torch.int32}[np.dtype(dtype)]


class RoutedExpertsCapturer:
    """Own the static device buffer ``(max_num_batched_tokens, num_layers, topk)`` of one step.

    Columns: with ``layers="moe"`` one per MoE layer, in model order; with ``layers="all"``
    one per decoder layer, and a dense layer's rows hold ``0, 1, …, topk - 1`` (a valid,
    recognisable filler that no router wrote; trainers drop those columns with
    ``R3Reader.get(..., layers=...)``). The buffer never moves or resizes, so a hook's
    write is a fixed-address device copy that a CUDA graph can record.
    """

    def __init__(
        self,
        layout: RoutingLayout,
        max_num_batched_tokens: int,
        *,
        moe_layers: Sequence[int],
        num_model_layers: int | None = None,
        layers: str = "moe",
        device: str | torch.device = "cpu",
    ) -> None:
        if not isinstance(layout, RoutingLayout):
            raise CaptureError(f"layout must be a RoutingLayout, not {layout!r:.40}")
        if layers not in LAYER_CHOICES:
            raise CaptureError(f"layers must be one of {LAYER_CHOICES}, not {layers!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise CaptureError(f"device {device!r:.40} is no torch device ({exc})") from None
        try:
            moe = sorted({operator.index(i) for i in moe_layers})
        except TypeError:
            raise CaptureError(f"moe_layers must be layer indices, got {moe_layers!r:.80}"
                               ) from None
        if not moe or moe[0] < 0:
            raise CaptureError(f"moe_layers must be non-negative layer indices, got {moe_layers!r}")
        if num_model_layers is None:
            num_model_layers = moe[-1] + 1
        num_model_layers = count(num_model_layers, "num_model_layers", 1, CaptureError)
        if moe[-1] >= num_model_layers:
            raise CaptureError(f"MoE layer {moe[-1]} >= num_model_layers {num_model_layers}")
        max_num_batched_tokens = count(max_num_batched_tokens, "max_num_batched_tokens", 1,
                                       CaptureError)
        width = len(moe) if layers == "moe" else num_model_layers
        if layout.num_layers != width:
            raise LayoutMismatchError(
                f"layers={layers!r} keeps {width} layer(s); the layout has {layout.num_layers}"
            )
        self.layout = layout
        self.layers = layers
        self.moe_layers = tuple(moe)
        self.num_model_layers = num_model_layers
        self.max_num_batched_tokens = max_num_batched_tokens
        self._column = {layer: (i if layers == "moe" else layer) for i, layer in enumerate(moe)}
        filler = torch.arange(layout.topk, dtype=torch_dtype(layout.dtype), device=device)
        self.buffer = filler.expand(max_num_batched_tokens, width, layout.topk).contiguous()
        self._offset = 0
        self._enabled = True

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def column(self, layer_id: int) -> int:
        """The buffer column of MoE layer ``layer_id``; CaptureError for any other layer."""
        try:
            column = self._column.get(layer_id)
        except TypeError:  # unhashable: no layer index either
            column = None
        if column is None:
            raise CaptureError(
                f"layer {layer_id!r} is not a MoE layer of this capturer "
                f"(MoE layers {list(self.moe_layers)})"
            )
        return column

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Write this forward's ``(tokens, topk)`` expert IDs of one layer; no host sync."""
        column = self.column(layer_id)
        if not self._enabled:
            return
        if not isinstance(topk_ids, torch.Tensor):
            raise CaptureError(f"layer {layer_id}: topk_ids must be a torch.Tensor, not "
                               f"{type(topk_ids).__name__}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.layout.topk:
            raise CaptureError(
                f"layer {layer_id}: topk_ids have shape {tuple(topk_ids.shape)}, expected "
                f"(tokens, {self.layout.topk})"
            )
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            # The narrowing copy would truncate them into other experts' IDs, unseen.
            raise CaptureError(f"layer {layer_id}: topk_ids hold {topk_ids.dtype}, not "
                               "integer expert IDs")
        end = self._offset + topk_ids.shape[0]
        if end > self.max_num_batched_tokens:
            raise CaptureError(
                f"layer {layer_id}: rows {self._offset}..{end} exceed the buffer of "
                f"{self.max_num_batched_tokens} tokens"
            )
        # Same-device copy with a narrowing cast: queued on the current stream.
        self.buffer[self._offset : end, column].copy_(topk_ids, non_blocking=True)

    def snapshot(self, num_rows: int) -> torch.Tensor:
        """A copy of the first ``num_rows`` rows, so the next forward may overwrite the buffer."""
        num_rows = count(num_rows, "num_rows", 0, CaptureError)
        if num_rows > self.max_num_batched_tokens:
            raise CaptureError(
                f"cannot snapshot {num_rows} rows of a {self.max_num_batched_tokens}-row buffer"
            )
        return self.buffer[:num_rows].clone()

    @contextmanager
    def at(self, row_offset: int) -> Iterator[None]:
        """Forwards inside write from ``row_offset`` on: an eager runner that splits one step
        into several forwards (one per request, say) places each at its batch rows."""
        row_offset = count(row_offset, "row_offset", 0, CaptureError)
        if row_offset >= self.max_num_batched_tokens:
            raise CaptureError(f"row offset {row_offset} is outside the buffer")
        previous, self._offset = self._offset, row_offset
        try:
            yield
        finally:
            self._offset = previous

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside leave the buffer untouched (a runner refilling its KV cache)."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def host_ring(self, depth: int, *, timing: bool = False) -> HostCopyRing:
        return HostCopyRing(self, depth, timing=timing)


class HostCopy:
    """Own one step's rows in a host buffer until the copy into it is known complete."""

    __slots__ = ("_host", "_event", "_started")

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None,
                 started: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._event = event
        self._started = started

    def copy_ms(self) -> float | None:
        """Device time of the copy, where the ring was built with ``timing=True``."""
        if self._started is None:
            return None
        self._event.synchronize()
        return self._started.elapsed_time(self._event)

    def result(self) -> np.ndarray:
        """Wait on this copy's event only, then return the rows as a numpy array of their own.

        The array is copied out of the ring slot: rows handed to requests outlive the slot,
        which the step ``depth`` steps later reuses.
        """
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy().copy()


class HostCopyRing:
    """Own the pinned host buffers and the copy stream that step snapshots travel through.

    ``depth`` slots (the engine's ``max_concurrent_batches``) are reused round-robin: the
    connector never has more steps in flight, so a slot is free again once its step was
    processed. On CPU the copy is synchronous and the results are the same.
    """

    def __init__(self, capturer: RoutedExpertsCapturer, depth: int, *,
                 timing: bool = False) -> None:
        depth = count(depth, "the host copy ring's depth", 1, CaptureError)
        device = capturer.device
        self._cuda = device.type == "cuda"
        shape, dtype = capturer.buffer.shape, capturer.buffer.dtype
        self._slots = [torch.empty(shape, dtype=dtype, pin_memory=self._cuda)
                       for _ in range(depth)]
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._events = [torch.cuda.Event(enable_timing=timing) if self._cuda else None
                        for _ in range(depth)]
        self._timing = timing and self._cuda
        self._device = device
        self._next = 0

    def copy(self, snapshot: torch.Tensor) -> HostCopy:
        """Enqueue the device-to-host copy of ``snapshot`` into the next slot."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        host = self._slots[i][: snapshot.shape[0]]
        event = self._events[i]
        if not self._cuda:
            host.copy_(snapshot)
            return HostCopy(host, None)
        stream = self._stream
        # The snapshot was taken on the compute stream: the copy stream must see it done.
        stream.wait_stream(torch.cuda.current_stream(self._device))
        started = torch.cuda.Event(enable_timing=True) if self._timing else None
        with torch.cuda.stream(stream):
            if started is not None:
                started.record(stream)
            host.copy_(snapshot, non_blocking=True)
            # The snapshot's memory must not be reused before this stream has read it.
            snapshot.record_stream(stream)
            event.record(stream)
        return HostCopy(host, event, started)
