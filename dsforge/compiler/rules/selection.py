"""Choosing which findings are reported: `--select`/`--ignore`, `[tool.dsforge]`, and inline `# dsforge:
ignore[...]` (whose comments dsforge.compiler.frontend.inline_ignores finds as the job file loads).

Selections name rule ids or id prefixes (``DSF3`` is every memory rule, ``DSF204`` one rule), as ruff and
flake8 do. An inline comment silences the named rules on its own line, or, when the comment is alone on
its line, on the line below it:

    parallel:
      pp: 8   # dsforge: ignore[DSF204]
    # dsforge: ignore[DSF301]
    training: {micro_batch: 4}

Loader and schema findings (DSF0xx) are always reported: a file that cannot be read is not a style
choice. An error is silenced only when its rule is marked suppressible (a cost-model estimate the user may
know better than); asking to silence another error is itself a DSF026 warning and the error stays, so a
job whose errors were "ignored" never reaches a launcher that cannot start it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from dsforge.compiler.frontend.inline_ignores import InlineIgnore
from dsforge.diagnostics import Diagnostic, Location, Severity

PREFIX = re.compile(r"^[A-Z]{2,8}\d{0,3}$")
#: Ids that are always reported, whatever the selection.
ALWAYS = ("DSF0",)


@dataclass(frozen=True)
class Selection:
    """Which rule ids to report: ``select`` (empty: all) minus ``ignore``; ``origin`` says where each came
    from."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    origin: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def over(self, base: Selection) -> Selection:
        """This (command-line) selection over ``base`` (the project's): a select replaces, an ignore adds."""
        return Selection(self.select or base.select, base.ignore + self.ignore,
                         {**base.origin, **self.origin})

    @classmethod
    def of(cls, select: Iterable[str] = (), ignore: Iterable[str] = (), origin: str = "") -> Selection:
        """A selection from id lists (see `parse_ids`), each id remembered as coming from ``origin``;
        ValueError for an id that is malformed or matches no rule."""
        sel, ign = tuple(parse_ids(select)), tuple(parse_ids(ignore))
        check_known((*sel, *ign))
        return cls(sel, ign, {p: origin for p in (*sel, *ign)})

    def wants(self, rule_id: str) -> bool:
        """True when findings of ``rule_id`` are reported under this selection."""
        if rule_id.startswith(ALWAYS):
            return True
        if self.select and not any(rule_id.startswith(p) for p in self.select):
            return False
        return not any(rule_id.startswith(p) for p in self.ignore)


def parse_ids(values: Iterable[str]) -> list[str]:
    """Comma- or space-separated ids and prefixes (``DSF204,DSF3``), upper-cased; ValueError names a bad
    one."""
    out: list[str] = []
    for value in values:
        for part in re.split(r"[,\s]+", value.strip()):
            if not part:
                continue
            if not PREFIX.match(part.upper()):
                raise ValueError(f"{part!r} is not a rule id or prefix (DSF204, DSF3, ...)")
            out.append(part.upper())
    return out


def _known(prefix: str, ids: set[str]) -> bool:
    return any(i.startswith(prefix) for i in ids)


def check_known(prefixes: Iterable[str]) -> None:
    """Raise ValueError naming the first id or prefix that matches no registered rule (a typo silences
    nothing)."""
    from dsforge.compiler.rules.registry import all_rules

    ids = {r.id for r in all_rules()}
    for prefix in prefixes:
        if not _known(prefix, ids):
            raise ValueError(f"{prefix} matches no rule (docs/rules.md lists them)")


@dataclass(frozen=True)
class Outcome:
    """The findings to report and how many were silenced (by selection and by inline comments)."""

    diagnostics: list[Diagnostic]
    silenced: int = 0


def apply(diags: list[Diagnostic], selection: Selection, inline: Iterable[InlineIgnore] = (),
          notes: bool = True) -> Outcome:
    """Filter findings by the selection and the inline comments; DSF026 for suppressions that cannot apply
    (unknown ids only when ``notes``: a second pass over the same job reports them once)."""
    from dsforge.compiler.rules.registry import all_rules

    rules = {r.id: r for r in all_rules()}
    ids = set(rules)
    problems: list[Diagnostic] = []
    for prefix in (*selection.select, *selection.ignore):
        if not _known(prefix, ids):
            where = selection.origin.get(prefix, "the selection")
            problems.append(Diagnostic("DSF026", Severity.WARNING,
                                       f"{where} names {prefix}, which matches no rule",
                                    Location(where), "check the id against docs/rules.md"))
    by_line: dict[tuple[str, int], set[str]] = {}
    for c in inline:
        if not c.ids:
            problems.append(Diagnostic("DSF026", Severity.WARNING,
                                       "`# dsforge: ignore` names no rule id, so it "
                                    "silences nothing", c.location,
                                    "write the ids: # dsforge: ignore[DSF204]"))
        for prefix in c.ids:
            if not PREFIX.match(prefix) or not _known(prefix, ids):
                problems.append(Diagnostic("DSF026", Severity.WARNING,
                                           f"`# dsforge: ignore[{prefix}]` names no "
                                        "known rule", c.location, "check the id against docs/rules.md"))
            else:
                by_line.setdefault((c.location.file, c.target_line), set()).add(prefix)
    kept: list[Diagnostic] = []
    refusals: list[Diagnostic] = []
    refused: set[tuple[str, Location]] = set()
    silenced = 0
    for d in diags:
        inline_hit = any(d.rule.startswith(p) for p in by_line.get((d.location.file, d.location.line), ()))
        wanted = selection.wants(d.rule) and not (inline_hit and not d.rule.startswith(ALWAYS))
        rule = rules.get(d.rule)
        if wanted or rule is None:
            kept.append(d)
            continue
        if rule.may_suppress(d.severity):
            silenced += 1
            continue
        kept.append(d)
        if (d.rule, d.location) in refused:
            continue
        refused.add((d.rule, d.location))
        refusals.append(Diagnostic("DSF026", Severity.WARNING,
                                   f"{d.rule} cannot be silenced: it is an error that "
                                "would stop the job from starting", d.location,
                                f"fix the job as {d.rule} says (only warnings, notes and estimate errors "
                                f"such as DSF301 can be ignored)", d.path))
    return Outcome(kept + (problems if notes else []) + refusals, silenced)
