"""Diagnostics: the one currency every stage of the compiler pays its findings in.

A diagnostic carries a stable rule id, a severity, the file/line/column of the offending
key, one sentence of what is wrong (with the numbers that make it wrong) and a concrete fix.
Formatters (text, JSON, GitHub annotations, SARIF) render lists of these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Severity(str, enum.Enum):
    """How bad a finding is; errors fail validation, warnings only with --strict."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Location:
    """A position in a job file (1-based line and column); line 0 means "the whole file"."""

    file: str
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Diagnostic:
    """One finding: rule id, severity, where, what is wrong and how to fix it."""

    rule: str
    severity: Severity
    message: str
    location: Location
    fix: str = ""
    path: tuple[str | int, ...] = ()
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key_path(self) -> str:
        """The dotted key path of the finding (``parallel.tp``), empty for file-level findings."""
        return dotted(self.path)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of this diagnostic."""
        out: dict[str, Any] = {
            "rule": self.rule,
            "severity": self.severity.value,
            "message": self.message,
            "file": self.location.file,
            "line": self.location.line,
            "column": self.location.column,
            "path": self.key_path,
            "fix": self.fix,
        }
        if self.details:
            out["details"] = self.details
        return out


def dotted(path: tuple[str | int, ...] | list[str | int]) -> str:
    """Render a key path as ``a.b[0].c``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class InputError(Exception):
    """Raised when the input cannot be used at all (exit code 2); carries its diagnostics."""

    def __init__(self, diagnostics: list[Diagnostic]):
        super().__init__("; ".join(d.message for d in diagnostics))
        self.diagnostics = diagnostics


def has_errors(diags: list[Diagnostic], strict: bool = False) -> bool:
    """True if any diagnostic fails the run (errors, or warnings too when strict)."""
    bad = {Severity.ERROR, Severity.WARNING} if strict else {Severity.ERROR}
    return any(d.severity in bad for d in diags)
