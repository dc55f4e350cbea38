"""Turn pydantic validation errors into dsforge diagnostics: one per offending key, in the user's words.

Pydantic reports a failed union once per member type (``zero: 5`` fails both "an int <= 3" and
"the literal 'auto'") and a missing section key once per key; a person wants one sentence per
mistake, pointing at the line that holds it. Rule ids: DSF020 unknown key, DSF021 wrong type,
DSF022 value out of range, DSF023 not an allowed value, DSF024 required key missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from dsforge.compiler.schema import JobSpec
from dsforge.compiler.source import SourceMap
from dsforge.diagnostics import Diagnostic, Severity, dotted

Path = tuple[str | int, ...]

#: Sections whose required keys a preset can supply (named in the fix of a missing key).
PRESET_SECTIONS = ("model", "hardware")

_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
          "string_too_short", "string_too_long", "string_pattern_mismatch", "degree_range", "multiple_of"}
_TYPE_NAMES = {"int", "str", "float", "bool", "list", "dict", "tuple", "none"}
_TAG = re.compile(r"[\[\](),'\-]")


def _is_tag(part: str | int) -> bool:
    """True for the union-member labels pydantic inserts into error locations (`constrained-int`, `literal[...]`)."""
    return isinstance(part, str) and (bool(_TAG.search(part)) or part in _TYPE_NAMES)


def _split(loc: Iterable[str | int]) -> tuple[Path, str | None, Path]:
    """Split an error location into (field path, first union tag, the path below that tag, tags removed)."""
    field: list[str | int] = []
    tag: str | None = None
    below: list[str | int] = []
    for part in loc:
        if _is_tag(part):
            tag = tag or str(part)
        elif tag is None:
            field.append(part)
        else:
            below.append(part)
    return tuple(field), tag, tuple(below)


def suggest(word: str, options: list[str]) -> str:
    """A " did you mean `x`?" suffix when a close match exists, else ""."""
    import difflib  # only needed when something is misspelled; keeps start-up lean

    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


def _fields(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def model_at(path: Path) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``path`` (to list its keys in a suggestion)."""
    model: Any = JobSpec
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return None
        model = _unwrap(field.annotation)
        if model is None:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def _description(path: Path) -> str:
    """The schema's description of the key at ``path`` ("" if unknown)."""
    owner = model_at(path[:-1])
    field = owner.model_fields.get(str(path[-1])) if owner and path else None
    return (field.description or "").rstrip(".") if field else ""


def _msg(err: Mapping[str, Any]) -> str:
    msg = str(err["msg"])
    if err["type"] in {"model_type", "dict_type", "model_attributes_type"}:
        return "must be a mapping of keys"
    msg = msg.replace("Input should be", "must be").replace("String should", "must").replace("Value should", "must")
    for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="), ("greater than", ">"),
                        ("less than", "<")):
        msg = msg.replace(words, sign)
    return msg[0].lower() + msg[1:] if msg else msg


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _literal_options(errors: list[Mapping[str, Any]]) -> list[str]:
    options: list[str] = []
    for err in errors:
        expected = str(err.get("ctx", {}).get("expected", ""))
        options += [o.strip().strip("'") for o in expected.replace(" or ", ", ").split(",") if o.strip()]
    return options


def _one(path: Path, errors: list[Mapping[str, Any]], smap: SourceMap) -> Diagnostic:
    """One diagnostic for all the errors pydantic reported about the value at ``path``."""
    where, value = dotted(path), errors[0].get("input")
    loc = smap.locate(path, value=True)
    literal = [e for e in errors if e["type"] == "literal_error"]
    others = [e for e in errors if e["type"] != "literal_error"]
    # A word where a fixed set of words is allowed: a misspelt choice, even if a union also takes a list/number.
    if literal and (not others or (isinstance(value, str) and all(e["type"].endswith("_type") for e in others))):
        options = _literal_options(literal)
        alt = "".join(f", or {_msg(e).removeprefix('must be ')}" for e in others)
        return Diagnostic("DSF023", Severity.ERROR, f"`{where}` is {_shown(value)}: must be one of "
                          f"{', '.join(options)}{alt}{suggest(str(value), options)}", loc,
                          f"use one of: {', '.join(options)}{alt}", path)
    ranged = [e for e in errors if e["type"] in _RANGE]
    if ranged:
        msg = _msg(ranged[0])
        if ranged[0]["type"] == "string_pattern_mismatch":  # a regex means little to a reader; the docs say it
            msg = f"must have the form of {_description(path) or msg}"
        return Diagnostic("DSF022", Severity.ERROR, f"`{where}` is {_shown(value)}: {msg}", loc,
                          f"change `{where}`: it {msg}", path)
    expected = " or ".join(dict.fromkeys(_msg(e).removeprefix("must be ") for e in errors))
    return Diagnostic("DSF021", Severity.ERROR, f"`{where}` has the wrong type ({_shown(value)}): must be {expected}",
                      loc, f"give `{where}` {expected}", path)


def _unknown(path: Path, smap: SourceMap) -> Diagnostic:
    key = str(path[-1])
    owner = model_at(path[:-1])
    options = _fields(owner) if owner else []
    section = dotted(path[:-1]) or "the top level"
    return Diagnostic("DSF020", Severity.ERROR, f"unknown key `{key}` in {section}{suggest(key, options)}",
                      smap.locate(path), f"remove it, or use one of: {', '.join(options)}" if options else "remove it",
                      path)


def _missing(section: Path, keys: list[str | int], smap: SourceMap) -> Diagnostic:
    if keys and all(isinstance(k, int) for k in keys):  # a fixed-length list (tuple) with too few items
        where = dotted(section)
        return Diagnostic("DSF022", Severity.ERROR, f"`{where}` has too few items: item {keys[0]} is missing",
                          smap.locate(section, value=True), f"give `{where}` {max(int(k) for k in keys) + 1} items",
                          section)
    names = ", ".join(f"`{k}`" for k in keys)
    where = dotted(section) or "the job file"
    hint = " or a `preset:` that supplies them" if section and section[0] in PRESET_SECTIONS else ""
    plural = "s" if len(keys) > 1 else ""
    return Diagnostic("DSF024", Severity.ERROR, f"{where} is missing required key{plural} {names}",
                      smap.locate(section, value=bool(section) and isinstance(section[-1], int)),
                      f"add {names}{hint}",
                      section + (keys[0],))


def schema_diagnostics(errors: Sequence[Mapping[str, Any]], smap: SourceMap) -> list[Diagnostic]:
    """Diagnostics for pydantic's error list: union branches folded, missing keys grouped by section."""
    out: list[Diagnostic] = []
    missing: dict[Path, list[str | int]] = {}
    groups: dict[Path, list[tuple[Path, Mapping[str, Any], bool]]] = {}
    for err in errors:
        field, tag, below = _split(err["loc"])
        if err["type"] == "extra_forbidden":
            out.append(_unknown(field + below, smap))
        elif err["type"] == "missing" and tag is None and field:
            missing.setdefault(field[:-1], []).append(field[-1])
        else:
            # A union member whose type the value had, failing deeper or on a bound, is the one that applies.
            matched = tag is not None and (bool(below) or err["type"] in _RANGE)
            groups.setdefault(field, []).append((field + below, err, matched))
    for items in groups.values():
        chosen = [(p, e) for p, e, m in items if m] or [(p, e) for p, e, _ in items]
        by_path: dict[Path, list[Mapping[str, Any]]] = {}
        for path, err in chosen:
            by_path.setdefault(path, []).append(err)
        out += [_one(path, errs, smap) for path, errs in by_path.items()]
    out += [_missing(section, keys, smap) for section, keys in missing.items()]
    return sorted(set(out), key=lambda d: (d.location.file, d.location.line, d.location.column, d.rule))
