"""JSON that strict parsers read: NaN and Infinity never reach a file or standard output.

Python's json module writes `NaN` and `Infinity`, which RFC 8259 does not allow and which strict
readers (JavaScript's JSON.parse, jq, Go, most SARIF viewers) reject. Every JSON document dsforge
writes goes through ``dumps``, which names the first non-finite number instead of writing it.
"""

from __future__ import annotations

import json
import math
from typing import Any


class NonFiniteError(ValueError):
    """A document holds NaN or an infinity; ``path`` is the dotted path of the first one."""

    def __init__(self, path: str, value: float) -> None:
        super().__init__(f"{path or '<top>'} is {value}, which JSON cannot hold")
        self.path, self.value = path, value


def non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """(dotted path, value) of the first NaN or infinity inside ``value`` (dicts, lists, tuples), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that raises NonFiniteError, naming where, rather than write NaN or Infinity."""
    found = non_finite(value)
    if found is not None:
        raise NonFiniteError(*found)
    return json.dumps(value, allow_nan=False, **kwargs)


def finite_or_text(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by its text (`nan`, `inf`), for reports that quote
    input."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_or_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_text(v) for v in value]
    return value
