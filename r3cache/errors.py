"""The one exception hierarchy of r3cache.

Every error r3cache raises derives from :class:`R3Error`.  Contract violations by
the caller (bad layouts, batches, cursors, generations) derive from
:class:`ContractError` and are raised by explicit checks, never by ``assert``, so
they survive ``python -O``.  Store failures derive from :class:`StoreError`; lower
libraries' errors are translated into these at the store boundary.
"""

from __future__ import annotations

from collections.abc import Iterable


def _preview(items: Iterable[str], limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f", … ({len(items) - limit} more)"
    return shown


class R3Error(Exception):
    """Base class of every error r3cache raises."""


class ContractError(R3Error, ValueError):
    """A caller broke the contract of a public entry point."""


class LayoutError(ContractError):
    """A RoutingLayout was given impossible sizes."""


class LayoutMismatchError(ContractError):
    """Rows, blocks or a stored namespace do not match the expected layout."""


class InvalidBatchError(ContractError):
    """A step batch is malformed (token counts, row ranges, rejected counts, ids)."""


class CursorError(ContractError):
    """A request's capture or emit cursor would move in an impossible way."""


class GenerationError(ContractError):
    """Step metadata moved the prefix-cache generation backwards or changed it mid-flight."""


class MetadataError(ContractError):
    """Step metadata is inconsistent (unknown request, run-and-finish in one step)."""


class CaptureError(ContractError):
    """A router hook, capturer or model binding was used outside its contract."""


class ReplayError(ContractError):
    """Recorded routes do not fit the model or forward they are replayed into."""


class IntegrationError(R3Error, RuntimeError):
    """A framework r3cache plugs into is not the version or API its integration knows."""


class StoreError(R3Error):
    """A block store failed to store or return blocks."""


class BlockNotFoundError(StoreError, KeyError):
    """Blocks that were asked for are not in the store."""

    def __init__(
        self,
        keys: Iterable[str],
        *,
        namespace: str | None = None,
        request_ids: Iterable[str] = (),
        cause: str = "never written, or evicted after its last release",
    ) -> None:
        self.keys = tuple(keys)
        self.namespace = namespace
        self.request_ids = tuple(request_ids)
        where = f" in namespace {namespace!r}" if namespace else ""
        who = f" for request(s) {_preview(map(repr, self.request_ids))}" if self.request_ids else ""
        message = (
            f"{len(self.keys)} block(s) missing{where}{who}: {_preview(self.keys)}"
            f" (likely cause: {cause})"
        )
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ManifestNotFoundError(BlockNotFoundError):
    """Requests have no manifest: never finished, released, expired, or another namespace."""

    def __init__(self, request_ids: Iterable[str], *, namespace: str | None = None) -> None:
        super().__init__(
            [f"manifest:{r}" for r in request_ids], namespace=namespace, request_ids=request_ids,
            cause="the request never finished with a completion, or its manifest was "
            "released or expired",
        )


class NamespaceNotFoundError(ContractError, StoreError):
    """A store has no metadata for the namespace asked for."""


class CorruptBlockError(StoreError):
    """Stored bytes under a block key are not a valid block of this layout."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"block {key!r} is corrupt: {reason}")


class StoreFullError(StoreError):
    """The store cannot take a batch without evicting pinned blocks; nothing was written."""


class StoreUnavailableError(StoreError):
    """The store's server could not be reached or did not answer in time."""


class StoreAccessError(StoreError):
    """The store refused the credentials or the command (AUTH, ACL), or another store took
    this one's owner name after its lease ran out."""


class StoreClosedError(StoreError):
    """The store was used after close()."""


class WriterError(StoreError):
    """The background writer failed earlier; the original error is the __cause__."""
