"""Turn the schema's list of mistakes into dsforge diagnostics: one per offending key, in the user's words.

Rule ids: DSF020 unknown key, DSF021 wrong type, DSF022 value out of range (or of the wrong form, or
too few items), DSF023 not an allowed value, DSF024 required key missing (grouped per section).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.spec.spec_types import Field, Issue, Path, Section
from dsforge.diagnostics import Diagnostic, Severity, dotted

#: Sections whose required keys a preset can supply (named in the fix of a missing key).
PRESET_SECTIONS = ("model", "hardware")
#: Keys users bring from Megatron for a feature dsforge does not have: the unknown-key error says so.
ABSENT_FEATURES = {
    frozenset({"etp", "expert_tp", "expert_tensor_parallel", "expert_tensor_parallel_size"}): (
        ("dsforge has no expert tensor parallelism (Megatron's --expert-tensor-parallel-size, MoE parallel "
         "folding): the expert layers use the dense tp groups and every tp rank holds its experts whole"),
        ("remove it; shard experts with parallel.ep, and keep "
         "tp before cp, ep and dp in parallel.order (DSF126)")),
}


def _absent_feature(key: str) -> tuple[str, str] | None:
    return next((why for keys, why in ABSENT_FEATURES.items() if key.lower() in keys), None)


def suggest(word: str, options: Sequence[str]) -> str:
    """A " did you mean `x`?" suffix when a close match exists, else ""."""
    import difflib  # only needed when something is misspelled; keeps start-up lean

    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


def field_at(path: Path, root: type[Section] = JobSpec) -> Field | None:
    """The schema field of the key at ``path`` (list indices skipped), or None."""
    owner: type[Section] | None = root
    found: Field | None = None
    for part in path:
        if isinstance(part, int):
            continue
        found = owner._by_key.get(part) if owner else None
        if found is None:
            return None
        owner = next(found.kind.sections(), None)
    return found


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _one(issue: Issue, smap: SourceMap) -> Diagnostic:
    path, where, shown = issue.path, dotted(issue.path), _shown(issue.value)
    loc = smap.locate(path, value=True)
    if issue.kind == "unknown":
        key, options = str(path[-1]), issue.options
        section = dotted(path[:-1]) or "the top level"
        absent = _absent_feature(key)
        if absent:
            return Diagnostic("DSF020", Severity.ERROR, f"unknown key `{key}` in {section}: {absent[0]}",
                              smap.locate(path), absent[1], path)
        return Diagnostic("DSF020", Severity.ERROR,
                          f"unknown key `{key}` in {section}{suggest(key, options)}", smap.locate(path),
                          f"remove it, or use one of: {', '.join(options)}", path)
    if issue.kind == "choice":
        listed = ", ".join(issue.options)
        return Diagnostic("DSF023", Severity.ERROR, f"`{where}` is {shown}: must be one of "
                          f"{listed}{issue.expected}{suggest(str(issue.value), issue.options)}", loc,
                          f"use one of: {listed}{issue.expected}", path)
    if issue.kind == "too_few":
        return Diagnostic("DSF022", Severity.ERROR,
                          f"`{where}` has too few items: item {len(issue.value)} is missing", loc,
                          f"give `{where}` {issue.expected} items", path)
    if issue.kind in ("range", "form"):
        # a regex means little to a reader; the field's description says the form
        described = field_at(path) if issue.kind == "form" else None
        msg = f"have the form of {described.description.rstrip('.')}" if described and described.description \
            else f"be {issue.expected}"
        return Diagnostic("DSF022", Severity.ERROR, f"`{where}` is {shown}: must {msg}", loc,
                          f"change `{where}`: it must {msg}", path)
    return Diagnostic("DSF021", Severity.ERROR, f"`{where}` has the wrong type "
                                                f"({shown}): must be {issue.expected}",
                      loc, f"give `{where}` {issue.expected}", path)


def _missing(section: Path, keys: list[str | int], smap: SourceMap) -> Diagnostic:
    names = ", ".join(f"`{k}`" for k in keys)
    where = dotted(section) or "the job file"
    hint = " or a `preset:` that supplies them" if section and section[0] in PRESET_SECTIONS else ""
    plural = "s" if len(keys) > 1 else ""
    return Diagnostic("DSF024", Severity.ERROR, f"{where} is missing required key{plural} {names}",
                      smap.locate(section, value=bool(section) and isinstance(section[-1], int)),
                      f"add {names}{hint}", section + (keys[0],))


def schema_diagnostics(issues: Sequence[Issue], smap: SourceMap) -> list[Diagnostic]:
    """Diagnostics for the schema's mistakes, missing keys grouped by section, in file order."""
    out: list[Diagnostic] = []
    missing: dict[Path, list[str | int]] = {}
    for issue in issues:
        if issue.kind == "missing":
            missing.setdefault(issue.path[:-1], []).append(issue.path[-1])
        else:
            out.append(_one(issue, smap))
    out += [_missing(section, keys, smap) for section, keys in missing.items()]
    return sorted(set(out), key=lambda d: (d.location.file, d.location.line, d.location.column, d.rule))
