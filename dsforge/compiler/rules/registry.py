"""The rule registry: every diagnostic id dsforge can report, of every stage, in one table.

Two kinds of entries share it. *Checks* are small functions registered with `@rule` that the
runner calls over a planned job (``phase="validate"``: validate, explain and compile run them;
``phase="compile"``: only compile, because they need what compile computes, such as the rewrite
plan). *Reported* ids are raised by code that is not a check (the loader, the schema, the emitter,
the runner itself); they are registered with `report_id` so that docs/rules.md, SARIF rule
descriptors and `--select`/`--ignore` know them too. tests/compiler/rules/test_rule_registry.py scans the
package for every `DSFnnn` literal and fails on one that is not registered here.

Rule-id ranges, one per stage (`STAGES`, the single place they are written down).

A rule never raises: the runner wraps every call, and an unexpected exception becomes a DSF900
diagnostic naming the rule (as cfn-lint does), so one broken check cannot hide the others.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsforge import extensions
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.spec.schema import JobSpec
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
class Stage:
    """One stage of the compiler and the id range its diagnostics take."""

    name: str
    first: int
    last: int
    title: str

    def holds(self, rule_id: str) -> bool:
        """True when ``rule_id`` (``DSFnnn``) lies in this stage's range."""
        number = _number(rule_id)
        return number is not None and self.first <= number <= self.last


#: The id range of every stage, in pipeline order (DESIGN.md). Ids are a public contract (job files and
#: CI configs ignore them by id), so a rule keeps its id when its code moves between modules.
STAGES: tuple[Stage, ...] = (
    Stage("input", 1, 19, "Input: reading the file, YAML, `extends`"),
    Stage("schema", 20, 99, "Schema: keys, types, values, presets, suppressions"),
    Stage("layout", 100, 199, "Model and layout: degrees, divisibility, order, CP, EP"),
    Stage("batch", 200, 299, "Batch and pipeline schedule"),
    Stage("memory", 300, 399, "Memory (cost model)"),
    Stage("communication", 400, 499, "Communication and topology"),
    Stage("deepspeed", 500, 599, "DeepSpeed and hardware compatibility"),
    Stage("emit", 600, 689, "Launch and emit: what the job directory and its launcher need"),
    Stage("emit-internal", 690, 699,
          "Emit failures: the cost model, the rewrite planner or a launcher failed"),
    Stage("plugins", 700, 799, "Plugins"),
    Stage("internal", 900, 999, "Internal errors"),
)
#: dsforge's own ids are DSFnnn; a plugin's take a prefix of its own (FIX001, ACME204).
ID_PATTERN = re.compile(r"^[A-Z]{2,8}\d{3}$")
PHASES = ("validate", "compile", "reported")


def _number(rule_id: str) -> int | None:
    return int(rule_id[3:]) if rule_id.startswith("DSF") and ID_PATTERN.match(rule_id) else None


def stage_of(rule_id: str) -> Stage | None:
    """The stage whose range holds ``rule_id``, or None for an id outside every range."""
    return next((s for s in STAGES if s.holds(rule_id)), None)


@dataclass(frozen=True)
class Rule:
    """A registered id: default severity, one-line summary, its source, and the check function (None for an id
    that code reports directly); ``exit_code`` 2 marks input that is unusable; an error can be silenced by
    ``--ignore`` or an inline comment only when ``suppressible`` (its finding is an estimate the user may know
    better than, not a job that cannot start)."""

    id: str
    severity: Severity
    summary: str
    source: str
    check: Check | None = None
    origin: str = "dsforge"
    phase: str = "validate"
    why: str = ""
    exit_code: int = 1
    suppressible: bool = False
    #: The layout-search fields (`search.space.Layout`'s names) whose values alone decide whether this check
    #: reports an error, everything else of the job fixed; None: any field may. The search asks such a check
    #: once per class of candidates equal in these fields, before estimating any of them
    #: (tests/compiler/search/test_search_rule_classes.py runs each on whole spaces and finds one verdict per
    #: class).
    reads: tuple[str, ...] | None = None
    #: The stacks (the job's `stack:` values) whose jobs the rule is about; empty: every stack. A rule about
    #: what dsforge's own runtime can build says ("dsforge",): another stack runs the job with its own engine,
    #: and validate only estimates it there, so run_rules does not ask the check for it (docs/rules.md says
    #: which).
    stacks: tuple[str, ...] = ()

    def applies_to(self, stack: str) -> bool:
        """True when the rule is about jobs of ``stack`` (every stack when it names none)."""
        return not self.stacks or stack in self.stacks

    @property
    def rationale(self) -> str:
        """Why the rule exists: its stated reason, else the check function's docstring."""
        return inspect.cleandoc(self.why or (self.check.__doc__ if self.check else "") or "")

    @property
    def stage(self) -> Stage | None:
        """The stage whose id range holds this rule."""
        return stage_of(self.id)

    def may_suppress(self, severity: Severity) -> bool:
        """True when a finding of this rule at ``severity`` may be silenced (warnings and notes always)."""
        return severity is not Severity.ERROR or self.suppressible


#: `stacks=` of a rule about what dsforge's own runtime builds and runs (DSF140-DSF145, DSF154, DSF606,
#: DSF607).
DSFORGE_RUNTIME: tuple[str, ...] = ("dsforge",)
#: `stacks=` of a rule about DeepSpeed's engine itself (its PipelineEngine, its MoE layer): the stacks that
#: run on it.
DEEPSPEED_ENGINE: tuple[str, ...] = ("dsforge", "megatron-deepspeed")

_RULES: dict[str, Rule] = {}


def register(entry: Rule) -> Rule:
    """Add one rule to the table; an id is registered once (a plugin cannot replace a built-in rule)."""
    if not ID_PATTERN.match(entry.id):
        raise ValueError(f"rule id {entry.id!r} is not upper-case letters and three digits (DSF204, ACME001)")
    if entry.phase not in PHASES:
        raise ValueError(f"rule {entry.id}: phase {entry.phase!r} is not one of {', '.join(PHASES)}")
    old = _RULES.get(entry.id)
    if old is not None and (old.check is not entry.check or old.check is None):
        raise ValueError(f"rule id {entry.id} registered twice")
    _RULES[entry.id] = entry
    return entry


def rule(rule_id: str, summary: str, *, severity: Severity = Severity.ERROR, source: str = "",
         origin: str = "dsforge", phase: str = "validate", suppressible: bool = False,
         reads: tuple[str, ...] | None = None, stacks: tuple[str, ...] = ()) -> Callable[[Check], Check]:
    """Register a check function under a stable id (``reads``: the layout fields its verdict depends on;
    ``stacks``: the stacks whose jobs it is about, empty for all)."""

    def wrap(fn: Check) -> Check:
        if _RULES.get(rule_id, None) is not None and _RULES[rule_id].check is fn:
            return fn
        register(Rule(rule_id, severity, summary, source, fn, origin, phase, suppressible=suppressible,
                      reads=reads, stacks=stacks))
        return fn

    return wrap


def report_id(rule_id: str, summary: str, why: str, source: str, *, severity: Severity = Severity.ERROR,
              exit_code: int = 1) -> Rule:
    """Register an id that code reports directly (not a check the runner calls), with why it exists."""
    return register(Rule(rule_id, severity, summary, source, None, "dsforge", "reported", why, exit_code))


def all_rules() -> list[Rule]:
    """Every registered id, checks and reported ones, sorted by id."""
    from dsforge.compiler.rules import load_builtin

    load_builtin()
    return [_RULES[k] for k in sorted(_RULES)]


def checks(phase: str = "validate") -> list[Rule]:
    """The check functions one phase runs (validate: every job; compile: also what needs compile's
    results)."""
    return [r for r in all_rules() if r.check is not None and r.phase == phase]


def get_rule(rule_id: str) -> Rule | None:
    """The registered rule with this id, or None."""
    all_rules()
    return _RULES.get(rule_id)


def snapshot() -> frozenset[str]:
    """The ids registered now (a plugin loader compares against it to attribute or roll back)."""
    return frozenset(_RULES)


def added_since(before: frozenset[str]) -> list[str]:
    """Ids registered after ``before`` was taken, sorted."""
    return sorted(set(_RULES) - before)


def retract(rule_ids: Iterable[str]) -> None:
    """Remove rules (what a failed plugin import registered before it failed)."""
    for rid in rule_ids:
        _RULES.pop(rid, None)


def attribute(rule_ids: Iterable[str], origin: str) -> None:
    """Record which plugin registered these rules."""
    for rid in rule_ids:
        _RULES[rid] = dataclasses.replace(_RULES[rid], origin=origin)


def _load_plugin_rules(entry: extensions.PluginEntry, load: Callable[[], Any]) -> list[str]:
    """The `dsforge.rules` loader: the plugin registers on import (or when called); a failure registers
    nothing."""
    before = snapshot()
    try:
        obj = load()  # a module registers its rules on import
        if callable(obj):
            obj()  # a `register()` function registers them when called
    except Exception:
        retract(added_since(before))
        raise
    added = added_since(before)
    if not added:
        raise extensions.PluginLoadError("registered no rules (decorate check "
                                         "functions with dsforge's @rule)")
    attribute(added, extensions.origin_label(entry))
    return [f"rule {rid}" for rid in added]


extensions.register_loader("rules", _load_plugin_rules)


def locate(ctx: Context, path: Path, at_key: bool = False) -> Location:
    """The location of a key path: its value where written, the section's `preset:` when the preset
    supplied it, else the nearest written ancestor key."""
    if path and ctx.written(path):
        return ctx.source.locate(path) if at_key else ctx.source.locate(path, value=True)
    if len(path) >= 2 and path[0] in ("model", "hardware") and ctx.written((path[0], "preset")):
        return ctx.source.locate((path[0], "preset"), value=True)
    return ctx.source.locate(path)


def run_rules(ctx: Context, rules: list[Rule] | None = None) -> list[Diagnostic]:
    """Run checks over one job (default: validate's); a crashing rule becomes a DSF900 diagnostic, never an
    exception. Reported ids in ``rules`` (no check function), and rules about another stack than the job's,
    are skipped."""
    out: list[Diagnostic] = []
    stack = getattr(ctx.spec, "stack", "dsforge")
    for r in rules if rules is not None else checks("validate"):
        if r.check is None or not r.applies_to(stack):
            continue
        try:
            for f in _iterate(r.check(ctx)):
                out.append(Diagnostic(r.id, f.severity or r.severity, f.message,
                                      locate(ctx, f.path, f.at_key), f.fix, f.path, f.details))
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            out.append(Diagnostic("DSF900", Severity.ERROR,
                                  f"internal error in rule {r.id} ({r.origin}): {type(exc).__name__}: {exc}",
                                  Location(ctx.source.file), "report this; the other rules still ran"))
    return sorted(out, key=lambda d: (d.location.file, d.location.line, d.location.column, d.rule))


def _iterate(found: Iterable[Finding] | None) -> Iterator[Finding]:
    yield from found or ()
