"""Renderers of a diagnostics list: one module per output format (text, json, github, sarif)."""

from __future__ import annotations

from collections.abc import Callable

from dsforge.diagnostics import Diagnostic

Formatter = Callable[[list[Diagnostic]], str]


def get(name: str) -> Formatter:
    """The formatter for ``name`` (text, json, github or sarif)."""
    from dsforge.formatters import github, json_format, sarif, text

    table: dict[str, Formatter] = {"text": text.render, "json": json_format.render, "github": github.render,
                                   "sarif": sarif.render}
    return table[name]


NAMES = ("text", "json", "github", "sarif")
