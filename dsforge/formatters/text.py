"""Human-readable diagnostics: `file:line:col: severity[ID] message` and an indented fix."""

from __future__ import annotations

from dsforge.diagnostics import Diagnostic, Severity


def render(diags: list[Diagnostic]) -> str:
    """Render diagnostics the way compilers do, followed by a one-line count."""
    lines = []
    for d in diags:
        # continuation lines are indented so each finding still starts with `file:line:col:` (for
        # grep/editors)
        lines.append(f"{d.location}: {d.severity.value}[{d.rule}] " + d.message.replace("\n", "\n    "))
        if d.fix:
            lines.append(f"  fix: {d.fix}")
    counts = {s: sum(d.severity is s for d in diags) for s in Severity}
    lines.append(f"{counts[Severity.ERROR]} error(s), {counts[Severity.WARNING]} warning(s), "
                 f"{counts[Severity.INFO]} note(s)")
    return "\n".join(lines) + "\n"
