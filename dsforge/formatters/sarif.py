"""SARIF 2.1.0, the format GitHub code scanning (and most static-analysis viewers) ingest."""

from __future__ import annotations

from pathlib import PurePath
from urllib.parse import quote

from dsforge import __version__
from dsforge.compiler.strict_json import dumps, finite_or_text
from dsforge.diagnostics import Diagnostic, Severity

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _rules(diags: list[Diagnostic]) -> list[dict[str, object]]:
    from dsforge.compiler.rules.registry import all_rules

    known = {r.id: (r.summary, r.rationale) for r in all_rules()}
    out = []
    for rule_id in sorted({d.rule for d in diags}):
        entry: dict[str, object] = {"id": rule_id}
        if rule_id in known:
            summary, rationale = known[rule_id]
            entry["shortDescription"] = {"text": summary}
            entry["fullDescription"] = {"text": " ".join(rationale.split()) or summary}
            entry["helpUri"] = f"https://github.com/dsforge/dsforge/blob/main/docs/rules.md#{rule_id.lower()}"
        out.append(entry)
    return out


def _uri(file: str) -> str:
    """A relative path stays a relative URI (resolved against the checkout by code scanning); an absolute
    path becomes a file:// URI, as SARIF 2.1.0 sec. 3.10 requires of an artifact location."""
    path = PurePath(file)
    return path.as_uri() if path.is_absolute() else quote(path.as_posix())


def _result(d: Diagnostic) -> dict[str, object]:
    region: dict[str, int] = {}
    if d.location.line:
        region = {"startLine": d.location.line, "startColumn": max(1, d.location.column)}
    location: dict[str, object] = {"artifactLocation": {"uri": _uri(d.location.file)}}
    if region:
        location["region"] = region
    text = d.message + (f"\nfix: {d.fix}" if d.fix else "")
    return {"ruleId": d.rule, "level": _LEVEL[d.severity], "message": {"text": text},
            "locations": [{"physicalLocation": location}]}


def render(diags: list[Diagnostic]) -> str:
    """A SARIF log with one run of the dsforge tool."""
    log = {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "dsforge", "version": __version__,
                                "informationUri": "https://github.com/dsforge/dsforge",
                                "rules": _rules(diags)}},
            "results": [_result(d) for d in diags],
        }],
    }
    return dumps(finite_or_text(log), indent=2) + "\n"
