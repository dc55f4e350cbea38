"""`file:line:col: severity: message [ID]`, the shape editors' problem matchers parse (VS Code's `$gcc`,
Emacs compilation mode, vim's errorformat `%f:%l:%c: %t%*[^:]: %m`).

The text format's `error[DSF104]` is what people read; these matchers expect a colon right after the
severity, so this format moves the id to the end. File-level findings point at 1:1 (the matchers need a
line), notes print as `note`, and the fix follows on its own indented line, which the matchers skip.
"""

from __future__ import annotations

from dsforge.diagnostics import Diagnostic, Severity

_WORD = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def render(diags: list[Diagnostic]) -> str:
    """One `file:line:col: severity: message [ID]` line per finding, each fix indented below it."""
    lines = []
    for d in diags:
        line, column = (d.location.line, max(1, d.location.column)) if d.location.line > 0 else (1, 1)
        message = d.message.replace("\n", " ")
        lines.append(f"{d.location.file}:{line}:{column}: {_WORD[d.severity]}: {message} [{d.rule}]")
        if d.fix:
            lines.append(f"    fix: {d.fix}")
    return "\n".join(lines) + ("\n" if lines else "")
