"""Renderers of a diagnostics list: one module per output format (text, json, github, sarif)."""

from __future__ import annotations

from collections.abc import Callable

from dsforge.diagnostics import Diagnostic

Formatter = Callable[[list[Diagnostic]], str]


def get(name: str) -> Formatter:
    """The formatter for ``name`` (text, json, github or sarif); KeyError for another name."""
    import importlib

    module = {"text": "text", "json": "json_format", "github": "github", "sarif": "sarif"}[name]
    # only the chosen module is imported: SARIF pulls in the rule registry's descriptions
    render: Formatter = importlib.import_module(f"dsforge.formatters.{module}").render
    return render


NAMES = ("text", "json", "github", "sarif")
