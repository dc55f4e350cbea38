"""The field language of DeepSpeed's pydantic config models, without torch: a field's kind, bounds and
spellings (`Field`), pydantic 2's lax coercions (`coerce`), the problems DeepSpeed raises (`Problem`), and the
validation of one section against a table of models (`validate_in`). ds_schema and ds_sections both describe
DeepSpeed 0.19.8's sections in it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Path = tuple[str | int, ...]


#: One past the largest int64 (pydantic's int fields are 64-bit).
I64 = 2**63


class Invalid(ValueError):
    """A value a pydantic field refuses; the message says what the field takes."""


@dataclass(frozen=True)
class Field:
    """One pydantic field: its kind (bool, int, float, str, path, enum, model, opaque), bounds and
    spellings."""

    kind: str
    default: Any = None
    optional: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    model: str = ""
    alias: str = ""
    replaced_by: str = ""  # a deprecated field DeepSpeed moves onto this one (and refuses beside it)


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT_TEXT = re.compile(r"[+-]?[0-9]+(_[0-9]+)*(\.0*)?")


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def coerce(field: Field, value: Any) -> Any:
    """The value pydantic 2 (lax mode) makes of ``value`` for ``field``; Invalid when it refuses it."""
    if value is None:
        if field.optional:
            return None
        raise Invalid("a value is required, not null")
    kind = field.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if is_number(value) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise Invalid("takes true or false")
    if kind == "int":
        return _bounded(field, _to_int(value))
    if kind == "float":
        if isinstance(value, (int, float)):
            return _bounded(field, float(value))
        if isinstance(value, str) and value.isascii():  # pydantic parses ASCII digits only
            try:
                return _bounded(field, float(value.strip()))
            except ValueError:
                pass
        raise Invalid("takes a number")
    if kind in ("str", "path"):
        if isinstance(value, str):
            return value
        raise Invalid("takes a string")
    if kind == "enum":
        return _enum(field, value)
    if kind in ("list", "strs"):  # `list` and `List[str]` (JSON gives lists only)
        if isinstance(value, list) and (kind == "list" or all(isinstance(v, str) for v in value)):
            return value
        raise Invalid("takes a list" + (" of strings" if kind == "strs" else ""))
    if kind == "model":
        if isinstance(value, dict):
            return value
        raise Invalid("takes a mapping")
    return value  # opaque: DeepSpeed's own validators, not described here


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < I64:
            return int(value)
        raise Invalid("takes a whole number" + (" (it has a fraction)" if math.isfinite(value) else ""))
    if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip().replace("_", "").split(".")[0])
    raise Invalid("takes a whole number (YAML reads 5e8 as text: write 500000000 or 5.0e+8)")


def _enum(field: Field, value: Any) -> Any:
    if all(isinstance(c, int) for c in field.choices):
        try:
            number = _to_int(value) if not isinstance(value, str) or value.strip() == value else None
        except Invalid:
            number = None
        if number in field.choices:
            return number
    elif value in field.choices and isinstance(value, str):
        return value
    raise Invalid("takes one of " + ", ".join(str(c) for c in field.choices) +
                  (" (lower case)" if isinstance(value, str) and value.lower() in field.choices else ""))


def _bounded(field: Field, number: float) -> Any:
    checks = ((field.ge, ">="), (field.gt, ">"), (field.le, "<="), (field.lt, "<"))
    for bound, word in checks:
        if bound is None:
            continue
        ok = {">=": number >= bound, ">": number > bound, "<=": number <= bound, "<": number < bound}[word]
        if not ok:
            raise Invalid(f"must be {word} {bound:g}")
    return number


@dataclass(frozen=True)
class Problem:
    """One reason DeepSpeed refuses a config: the key path in the ds_config, what is wrong, and how to fix it.

    ``kind``: "extra" (a key the section does not have), "value" (a type or range), "shape" (a section that
    is not a mapping), "cross" (values that DeepSpeed refuses together).
    """

    path: Path
    message: str
    fix: str
    kind: str = "value"


def where(path: Path) -> str:
    """A key path as the dotted name a message shows."""
    return ".".join(str(p) for p in path)


def validate_in(models: Mapping[str, dict[str, Field]], name: str, data: Mapping[str, Any],
                path: Path) -> tuple[dict[str, Any], list[Problem]]:
    """Validate one pydantic section as DeepSpeed's model does: the values it ends up with, and its problems.

    A value "auto" is dropped, the field's default applies (DeepSpeedConfigModel.__init__, which HF's
    integration relies on; measured: nested offload blocks drop it too).
    """
    fields, out, problems = models[name], {}, []
    by_alias = {f.alias: key for key, f in fields.items() if f.alias}
    given: set[str] = set()
    for key, value in data.items():
        if isinstance(value, str) and value == "auto":
            continue
        field_name = by_alias.get(key, key)
        if field_name not in fields or (
            field_name == key and fields[key].alias and fields[key].alias in data
        ):
            # pydantic prefers the alias: the field's own name beside it is an extra key
            problems.append(Problem((*path, key), f"`{where((*path, key))}` is not a key DeepSpeed's "
                                    f"{where(path)} takes", "fix the spelling or remove it", "extra"))
            continue
        field = fields[field_name]
        try:
            out[field_name] = coerce(field, value)
        except Invalid as exc:
            problems.append(Problem((*path, key), f"`{where((*path, key))}`={value!r}: DeepSpeed {exc}",
                                    fix_for(field)))
            continue
        given.add(field_name)
        if field.kind == "model" and out[field_name] is not None:
            out[field_name], nested = validate_in(models, field.model, out[field_name], (*path, key))
            problems += nested
    for field_name, field in fields.items():
        if field.replaced_by and field_name in given:
            new = field.replaced_by
            if new in given:
                problems.append(
                    Problem(
                        (*path, field_name),
                        f"`{where((*path, field_name))}` is the deprecated "
                        f"spelling of `{new}`, and DeepSpeed refuses both together",
                        f"remove {field_name} (dsforge writes {new})",
                        "cross",
                    )
                )
            elif out[field_name] is not None:
                out[new] = {"device": "cpu"} if models[name][new].kind == "model" and out[field_name] else (
                    None if models[name][new].kind == "model" else out[field_name])
    for field_name, field in fields.items():
        out.setdefault(field_name, field.default)
    return out, problems


def fix_for(field: Field) -> str:
    """What a problem's fix says a field takes."""
    if field.kind == "enum":
        return "use one of " + ", ".join(str(c) for c in field.choices)
    if field.kind in ("int", "float"):
        bounds = [f"{w} {b:g}" for b,
                  w in ((field.ge, ">="), (field.gt, ">"), (field.le, "<="),
                        (field.lt, "<")) if b is not None]
        return f"give a {'whole ' if field.kind == 'int' else ''}number" + (
            f" ({', '.join(bounds)})" if bounds else ""
        )
    if field.kind == "model":
        return "give a mapping of its keys, or remove it"
    return "give true or false" if field.kind == "bool" else "give a string"
