"""The rule registry: each check is a small registered function with a stable id.

Rule-id ranges, one per stage (the single place they are written down):

* DSF0xx  input: reading, YAML, `extends`, schema, presets (load errors exit 2)
* DSF1xx  model and layout: degrees, divisibility of heads/FFN/vocab/layers, order, CP, EP
* DSF2xx  batch and pipeline schedule
* DSF3xx  memory (cost model)
* DSF4xx  communication and topology
* DSF5xx  DeepSpeed and hardware compatibility (what DeepSpeed would reject only after launch)
* DSF6xx  compile and emit
* DSF7xx  plugins
* DSF9xx  internal errors (a rule crashed)

A rule never raises: the runner wraps every call, and an unexpected exception becomes a DSF900
diagnostic naming the rule (as cfn-lint does), so one broken check cannot hide the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsforge.compiler.plan import Plan
from dsforge.compiler.schema import JobSpec
from dsforge.compiler.source import SourceMap
from dsforge.diagnostics import Diagnostic, Location, Severity

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Finding:
    """What a rule yields: a message, a fix, the key path it is about; severity defaults to the rule's."""

    message: str
    fix: str
    path: Path = ()
    severity: Severity | None = None
    details: dict[str, Any] = field(default_factory=dict)
    at_key: bool = False  # point at the key itself (unknown keys) rather than its value


@dataclass(frozen=True)
class Context:
    """What a rule sees: the typed spec, the resolved plan and the source map."""

    spec: JobSpec
    plan: Plan
    source: SourceMap
    raw: dict[str, Any]

    def written(self, path: Path) -> bool:
        """True if the user (or an `extends` base) wrote this key, rather than a default or preset."""
        node: Any = self.raw
        for part in path:
            found = (isinstance(node, dict) and part in node) or (
                isinstance(node, list) and isinstance(part, int) and part < len(node))
            if not found:
                return False
            node = node[part]
        return True


Check = Callable[[Context], Iterable[Finding]]


@dataclass(frozen=True)
class Rule:
    """A registered check: id, default severity, one-line summary, its source, and the function."""

    id: str
    severity: Severity
    summary: str
    source: str
    check: Check
    origin: str = "dsforge"

    @property
    def rationale(self) -> str:
        """Why the rule exists: the check function's docstring."""
        return inspect.cleandoc(self.check.__doc__ or "")


_RULES: dict[str, Rule] = {}


def rule(rule_id: str, summary: str, *, severity: Severity = Severity.ERROR, source: str = "",
         origin: str = "dsforge") -> Callable[[Check], Check]:
    """Register a check function under a stable id."""

    def wrap(fn: Check) -> Check:
        if rule_id in _RULES and _RULES[rule_id].check is not fn:
            raise ValueError(f"rule id {rule_id} registered twice")
        _RULES[rule_id] = Rule(rule_id, severity, summary, source, fn, origin)
        return fn

    return wrap


def all_rules() -> list[Rule]:
    """Every registered rule, sorted by id."""
    from dsforge.compiler.rules import load_builtin

    load_builtin()
    return [_RULES[k] for k in sorted(_RULES)]


def locate(ctx: Context, path: Path, at_key: bool = False) -> Location:
    """The location of a key path: its value where written, the section's `preset:` when the preset
    supplied it, else the nearest written ancestor key."""
    if path and ctx.written(path):
        return ctx.source.locate(path) if at_key else ctx.source.locate(path, value=True)
    if len(path) >= 2 and path[0] in ("model", "hardware") and ctx.written((path[0], "preset")):
        return ctx.source.locate((path[0], "preset"), value=True)
    return ctx.source.locate(path)


def run_rules(ctx: Context, rules: list[Rule] | None = None) -> list[Diagnostic]:
    """Run every rule over one job; a crashing rule becomes a DSF900 diagnostic, never an exception."""
    out: list[Diagnostic] = []
    for r in rules if rules is not None else all_rules():
        try:
            for f in _iterate(r.check(ctx)):
                out.append(Diagnostic(r.id, f.severity or r.severity, f.message, locate(ctx, f.path, f.at_key), f.fix,
                                      f.path, f.details))
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            out.append(Diagnostic("DSF900", Severity.ERROR,
                                  f"internal error in rule {r.id} ({r.origin}): {type(exc).__name__}: {exc}",
                                  Location(ctx.source.file), "report this; the other rules still ran"))
    return sorted(out, key=lambda d: (d.location.file, d.location.line, d.location.column, d.rule))


def _iterate(found: Iterable[Finding] | None) -> Iterator[Finding]:
    yield from found or ()
