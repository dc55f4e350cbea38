"""Diagnostics as a JSON document (one object per finding)."""

from __future__ import annotations

from dsforge.compiler.strict_json import dumps, finite_or_text
from dsforge.diagnostics import Diagnostic


def render(diags: list[Diagnostic]) -> str:
    """A JSON object with a `diagnostics` list, stable key order (a NaN a finding quotes is written as
    text)."""
    return dumps(finite_or_text({"version": 1, "diagnostics": [d.to_dict() for d in diags]}), indent=2) + "\n"
