"""Diagnostics as a JSON document (one object per finding)."""

from __future__ import annotations

import json

from dsforge.diagnostics import Diagnostic


def render(diags: list[Diagnostic]) -> str:
    """A JSON object with a `diagnostics` list, stable key order."""
    return json.dumps({"version": 1, "diagnostics": [d.to_dict() for d in diags]}, indent=2) + "\n"
