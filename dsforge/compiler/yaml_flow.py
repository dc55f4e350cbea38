"""A YAML flow collection (`[...]`, `{...}`) left open: the error names the line it opened and where parsing
stopped.

PyYAML reports the place it gave up (often the next key, lines below) as the problem and the
opening bracket as the context ("while parsing a flow mapping"); the fix belongs at the bracket, so
the diagnostic points there and names both lines.
"""

from __future__ import annotations

from typing import Any

from dsforge.diagnostics import Location

KINDS = {"while parsing a flow mapping": ("mapping", "{", "}"),
         "while parsing a flow sequence": ("sequence", "[", "]")}


def unclosed_flow(exc: Any, display: str) -> tuple[str, Location, str] | None:
    """(message, location of the opening bracket, fix) for an unclosed flow collection, or None for other
    errors."""
    kind = KINDS.get((getattr(exc, "context", None) or "").strip())
    opened, stopped = getattr(exc, "context_mark", None), getattr(exc, "problem_mark", None)
    if kind is None or opened is None or stopped is None or opened.line == stopped.line:
        return None
    name, left, right = kind
    problem = (getattr(exc, "problem", None) or "").strip()
    message = (f"YAML syntax error: the flow {name} `{left}` opened at line {opened.line + 1}, column "
               f"{opened.column + 1} is not closed: the parser gave up at line {stopped.line + 1}, column "
               f"{stopped.column + 1} ({problem})")
    fix = f"close it with `{right}` on line {opened.line + 1}, or write it as an indented block"
    return message, Location(display, opened.line + 1, opened.column + 1), fix
