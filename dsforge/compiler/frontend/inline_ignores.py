"""The inline `# dsforge: ignore[...]` comments of a job file's text, found as it loads
(dsforge.compiler.rules.selection applies them to the findings)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsforge.diagnostics import Location

#: `# dsforge: ignore[DSF204, DSF3]`; the brackets are required (a bare ignore would silence everything).
COMMENT = re.compile(r"#\s*dsforge:\s*ignore\b(?:\[([^\]]*)\])?")


@dataclass(frozen=True)
class InlineIgnore:
    """One suppression comment: the ids it names, the line it applies to, and where it was written."""

    ids: tuple[str, ...]
    target_line: int
    location: Location


def _comment_start(line: str) -> int | None:
    """Where the line's YAML comment starts, or None: a `#` at the start or after a blank, outside quotes."""
    quote: str | None = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'" and (i == 0 or line[i - 1] in " \t:[{,-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
        i += 1
    return None


def scan_comments(text: str, file: str) -> list[InlineIgnore]:
    """Every `# dsforge: ignore[...]` comment of a job file's text."""
    out: list[InlineIgnore] = []
    for number, line in enumerate(text.splitlines(), start=1):
        start = _comment_start(line)
        if start is None:
            continue
        match = COMMENT.search(line, start)
        if match is None:
            continue
        ids = tuple(p.strip().upper() for p in (match.group(1) or "").split(",") if p.strip())
        alone = not line[:start].strip()
        out.append(InlineIgnore(ids, number + 1 if alone else number,
                                Location(file, number, match.start() + 1)))
    return out
