"""The fenced code blocks of README.md (or another page), in order, with the heading each
stands under."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language tag ('' for none), text, first line and heading."""

    lang: str
    text: str
    line: int
    heading: str
    source: str = "README.md"

    def __str__(self) -> str:
        return f"{self.source}:{self.line} ({self.lang or 'plain'} block under {self.heading!r})"


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of ``path``; an unclosed fence is an error, not a silent skip."""
    found: list[Block] = []
    heading, lang, start, body = "", None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, body = fence.group(1), number + 1, []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif fence and not fence.group(1):
            found.append(Block(lang, "\n".join(body) + "\n", start, heading, path.name))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise ValueError(f"{path.name}:{start - 1}: a ``` fence is never closed")
    return found


def python_block(after: str) -> Block:
    """The first Python block whose heading or preceding text contains ``after``."""
    text = README.read_text()
    line = text[: text.index(after)].count("\n") + 1
    return next(b for b in blocks() if b.lang == "python" and b.line > line)
