"""Writers that take puts off the engine thread: a thread (background), or a helper
process that reads blocks in shared memory (process, helper; slots: the mappings, arena:
the in-process tier's blocks, ring: the rest); both bound every wait (bounded)."""

from __future__ import annotations

from typing import Any

from r3cache.errors import ContractError
from r3cache.store.memory import MemoryBlockStore

WRITERS = ("auto", "thread", "process")
# What an unavailable store does to the engine: "raise" a typed error at the next call,
# or drop the batch and go on ("incomplete": those requests' read-back fails clearly).
POLICIES = ("raise", "incomplete")


def check_writer(writer: object) -> None:
    if writer not in WRITERS:
        raise ContractError(f"writer must be 'auto', 'thread' or 'process', not {writer!r:.40}")


def check_policy(on_unavailable: object) -> None:
    if on_unavailable not in POLICIES:
        raise ContractError(f"on_unavailable must be one of {POLICIES}, not "
                            f"{on_unavailable!r:.40}")


def check_choice(writer: object, on_unavailable: object, embedded: bool) -> None:
    """Refuse a writer and a policy that cannot serve a store together, before any store
    opens (``embedded``: the store in this process)."""
    check_writer(writer)
    check_policy(on_unavailable)
    if writer != "process":
        return
    if embedded:
        raise ContractError("writer='process' cannot serve the embedded store (a helper "
                            "process cannot reach this process's memory): use 'auto' or "
                            "'thread'")
    if on_unavailable != "raise":
        # Said here rather than ignored: the helper process only knows "raise".
        raise ContractError("writer='process' supports on_unavailable='raise' only")


def choose_writer(store: Any, writer: str, on_unavailable: str) -> str:
    """``inline``, ``thread`` or ``process``: how an engine writes to ``store``.

    The embedded store (in this process) is written in place under ``auto``: its puts are
    dict updates and copies under the GIL, which a writer thread hands back and forth
    while the engine's thread is busy. ``thread`` puts it behind a writer thread, as vLLM's
    own connector does, for an engine whose thread waits on the device through the
    forward pass (docs/BENCHMARKS.md measures both). For a durable store ``auto`` is the
    helper process where it can serve: it is what keeps an engine's step near the
    embedded store's cost with Redis behind it, but it knows only the "raise" policy and
    needs a store it can reopen (Redis), so anything else gets the thread.
    """
    embedded = isinstance(store, MemoryBlockStore)
    check_choice(writer, on_unavailable, embedded)
    if embedded:
        return "thread" if writer == "thread" else "inline"
    if writer == "auto":
        reopenable = getattr(store, "reopen_args", None) is not None
        return "process" if reopenable and on_unavailable == "raise" else "thread"
    return writer
