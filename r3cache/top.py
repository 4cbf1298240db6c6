"""`r3cache top`: the namespaces of a Redis, redrawn every few seconds until `q` or Ctrl-C."""

from __future__ import annotations

import contextlib
import curses
import sys
import time
from collections.abc import Iterator

from r3cache.errors import StoreUnavailableError
from r3cache.inspection import Snapshot, snapshot
from r3cache.store import display_url
from r3cache.store.redis.store import SAFE_POLICIES


def render(now: Snapshot, before: Snapshot | None, url: str) -> list[str]:
    """The screen's lines: the server's memory, then one block of lines per namespace;
    rates compare with the previous snapshot (none on the first)."""
    server = now.server
    limit = f"{server.maxmemory:,}" if server.maxmemory else "no maxmemory"
    share = f" ({server.used_memory / server.maxmemory:.0%})" if server.maxmemory else ""
    lines = [f"r3cache top  {url}",
             f"memory     {server.used_memory:,} used of {limit}{share}, "
             f"policy {server.policy}"]
    if any(p not in SAFE_POLICIES for p in server.policy.split(",")):
        lines.append("WARNING    maxmemory-policy is not volatile-*: Redis may evict blocks "
                     "that are held")
    seconds = now.at - before.at if before else 0.0
    if seconds > 0:
        reads = (server.key_reads - before.server.key_reads) / seconds
        lines.append(f"reads      {reads:,.0f} keys/s (the whole server)")
    earlier = {v.namespace: v for v in before.namespaces} if before else {}
    for view in now.namespaces:
        stats = view.stats
        lines += ["", f"{view.namespace}  layout {view.fingerprint}",
                  f"  blocks     {stats.blocks:,} ({stats.pinned_blocks:,} pinned, "
                  f"{stats.blocks - stats.pinned_blocks:,} idle), "
                  f"{stats.bytes_used:,} bytes",
                  f"  manifests  {stats.manifests:,}",
                  f"  owners     {len(view.live_owners)} live, {len(view.dead_owners)} dead"]
        if view.namespace in earlier and seconds > 0:
            was = earlier[view.namespace].stats
            lines.append(f"  rates      {(stats.blocks - was.blocks) / seconds:+,.1f} blocks/s, "
                         f"{(stats.manifests - was.manifests) / seconds:+,.1f} manifests/s")
    if not now.namespaces:
        lines += ["", "no r3cache namespaces found"]
    return lines


def frames(url: str, namespace: str | None) -> Iterator[list[str]]:
    """Each look's lines, one look per item. Once one was shown, a look that finds Redis
    unavailable shows that one again under the line that says why: an operator watches
    through an outage, which is when top is wanted, instead of being thrown out of it. The
    first look raises (a wrong URL ends top at once)."""
    where = display_url(url)
    before = shown = None
    while True:
        try:
            now = snapshot(url, namespace)
        except StoreUnavailableError as exc:
            if shown is None:
                raise
            yield render(shown, before, where) + [
                f"UNAVAILABLE {time.strftime('%H:%M:%S')}  {exc}; shown: the last look"]
            continue
        before, shown = shown, now
        yield render(shown, before, where)


def run(url: str, namespace: str | None, interval: float) -> int:
    """Redraw every ``interval`` seconds; `q` or Ctrl-C ends it with the terminal restored.
    Where stdout is no terminal (a pipe, a file, `kubectl exec` without `-t`), each
    snapshot is printed as plain lines instead, a blank line between, until Ctrl-C."""
    if not sys.stdout.isatty():
        with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
            for lines in frames(url, namespace):
                print("\n".join(lines), end="\n\n", flush=True)
                time.sleep(interval)
        return 0

    def loop(screen) -> None:
        curses.curs_set(0)
        screen.timeout(100)  # poll the keyboard every 0.1 s between redraws
        for lines in frames(url, namespace):
            screen.erase()
            height, width = screen.getmaxyx()
            lines += ["", f"every {interval:g} s; q quits"]
            for row, line in enumerate(lines[: height - 1]):
                screen.addnstr(row, 0, line, width - 1)
            screen.refresh()
            waited = 0.0
            while waited < interval:
                if screen.getch() in (ord("q"), ord("Q")):
                    return
                waited += 0.1

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: quit like q
        curses.wrapper(loop)
    return 0
