"""Renderers of a diagnostics list: one module per output format (text, json, github, sarif)."""

from __future__ import annotations

from collections.abc import Callable

from dsforge.diagnostics import Diagnostic

Formatter = Callable[[list[Diagnostic]], str]


def get(name: str) -> Formatter:
    """The formatter for ``name`` (text, json, github, sarif or gcc); KeyError for another name."""
    import importlib

    module = {"text": "text", "json": "json_format", "github": "github", "sarif": "sarif", "gcc": "gcc"}[name]
    # only the chosen module is imported: SARIF pulls in the rule registry's descriptions
    render: Formatter = importlib.import_module(f"dsforge.formatters.{module}").render
    return render


NAMES = ("text", "json", "github", "sarif", "gcc")


def write_report(text: str, output: str) -> str | None:
    """Write a report file whole (a temporary file renamed into place); returns why it failed, or None."""
    import contextlib
    import os
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=".dsforge-report-", dir=os.path.dirname(os.path.abspath(output)))
    except OSError as exc:
        return f"cannot write the report to {output}: {exc.strerror or exc}"
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, output)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return f"cannot write the report to {output}: {exc.strerror or exc}"
    return None
