"""GitHub Actions workflow commands, which annotate the offending line in a pull request."""

from __future__ import annotations

from dsforge.diagnostics import Diagnostic, Severity

_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render(diags: list[Diagnostic]) -> str:
    """One `::error file=..,line=..,col=..,title=..::message` line per diagnostic."""
    out = []
    for d in diags:
        props = [f"file={_escape_prop(d.location.file)}"]
        if d.location.line:
            props += [f"line={d.location.line}", f"col={d.location.column}"]
        props.append(f"title={_escape_prop(d.rule)}")
        body = d.message + (f" (fix: {d.fix})" if d.fix else "")
        out.append(f"::{_LEVEL[d.severity]} {','.join(props)}::{_escape_data(body)}")
    return "\n".join(out) + ("\n" if out else "")
