"""Frozen, documented sections of the job file and the checks of their values.

Each key is declared once (its kind, bounds, default and description); the value checks, the JSON
Schema (`dsforge schema`, docs/job-file.md) and the list of mistakes that `schema_errors` turns into
diagnostics all derive from that declaration. It replaces pydantic because `dsforge validate` must
start fast in a fresh process: importing pydantic and building the job model took ~170 ms of a
~300 ms run (python -X importtime), while this module costs about a millisecond. The method names
(`model_validate`, `model_copy`, `model_dump`, `model_fields`, `model_fields_set`) follow pydantic's,
so callers read the same.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_kwargs: Any) -> Callable[[Any], Any]:
        return lambda cls: cls

Path = tuple[str | int, ...]


class Issue(NamedTuple):
    """One mistake in job data: where it is, what kind, and what is allowed there.

    ``kind`` is one of unknown, type, range, form, choice, missing, too_few. ``expected`` reads after
    "must be" (for a choice: the alternatives besides ``options``, e.g. ", or an integer >= 1").
    """

    path: Path
    kind: str
    expected: str = ""
    value: Any = None
    options: tuple[str, ...] = ()


class SpecError(ValueError):
    """Job data that does not fit the schema; ``issues`` lists every mistake found."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        shown = "; ".join(f"{'.'.join(map(str, i.path)) or '<top>'}: {i.kind} "
                          f"{i.expected}".strip() for i in issues)
        super().__init__(f"{len(issues)} schema error(s): {shown}")


class FrozenSpecError(AttributeError):
    """Assignment to a field of a (frozen) section."""


class _Bad:
    """The result of a failed check (its issues are already recorded)."""


BAD: Any = _Bad()


class Kind:
    """What a key accepts: checks a value (recording issues) and describes itself as JSON Schema."""

    expected = "a value"

    def accepts(self, value: Any) -> bool:
        """True when ``value`` has the Python type this kind takes (bounds aside); unions use it to pick a
        member."""
        return True

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        """The value to store, or BAD after appending what is wrong with ``value`` to ``issues``."""
        return value

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        """This kind as a JSON Schema node (section definitions go into ``defs``)."""
        return {}

    def sections(self) -> Iterator[type[Section]]:
        """The section classes this kind holds (to walk the schema)."""
        return iter(())


def _bounds_phrase(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    low = f">= {_num(ge)}" if ge is not None else f"> {_num(gt)}" if gt is not None else ""
    high = f"<= {_num(le)}" if le is not None else f"< {_num(lt)}" if lt is not None else ""
    return " and ".join(p for p in (low, high) if p)


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


class _Number(Kind):
    noun = "a number"

    def __init__(self, ge: float | None = None, gt: float | None = None, le: float | None = None,
                 lt: float | None = None) -> None:
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt
        self.bounds = _bounds_phrase(ge, gt, le, lt)
        self.expected = f"{self.noun} {self.bounds}".strip()

    def _violated(self, value: float) -> str:
        """The bound ``value`` breaks ("" when none), as the reader should fix it."""
        if (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt):
            return _bounds_phrase(self.ge, self.gt, None, None)
        if (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt):
            return _bounds_phrase(None, None, self.le, self.lt)
        return ""

    def _checked(self, value: float, path: Path, issues: list[Issue]) -> Any:
        broken = self._violated(value)
        if not broken:
            return value
        issues.append(Issue(path, "range", broken, value))
        return BAD

    def _bounds_schema(self) -> dict[str, Any]:
        keys = (("minimum", self.ge), ("exclusiveMinimum", self.gt), ("maximum", self.le),
                ("exclusiveMaximum", self.lt))
        return {k: v for k, v in keys if v is not None}


class Int(_Number):
    """A whole number (booleans refused), optionally bounded."""

    noun = "an integer"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not self.accepts(value):
            issues.append(Issue(path, "type", self.expected, value))
            return BAD
        return self._checked(value, path, issues)

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return {"type": "integer", **self._bounds_schema()}


# A YAML 1.1 reader takes `3e-4` (no dot) for a string; a number written so is still meant as a number.
_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class Float(_Number):
    """A finite real number, stored as float; ints and decimal strings such as `3e-4` are taken.

    ``min_nonzero`` allows 0 but no positive value below it (a rate of 0 means "not supported"; one of
    5e-324 would make every duration computed from it infinite).
    """

    def __init__(self, ge: float | None = None, gt: float | None = None, le: float | None = None,
                 lt: float | None = None, min_nonzero: float | None = None) -> None:
        super().__init__(ge, gt, le, lt)
        self.min_nonzero = min_nonzero
        if min_nonzero is not None:
            self.expected = f"{self.expected}, 0 or at least {_num(min_nonzero)}"

    def _violated(self, value: float) -> str:
        if self.min_nonzero is not None and 0 < value < self.min_nonzero:
            return f"0 or at least {_num(self.min_nonzero)}"
        return super()._violated(value)

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            value = float(value)
        if not self.accepts(value):
            issues.append(Issue(path, "type", self.expected, value))
            return BAD
        value = float(value)
        if not math.isfinite(value):
            issues.append(Issue(path, "range", f"a finite number {self.bounds}".strip(), value))
            return BAD
        return self._checked(value, path, issues)

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "number", **self._bounds_schema()}
        if self.min_nonzero is not None:
            node["not"] = {"exclusiveMinimum": 0, "exclusiveMaximum": self.min_nonzero}
        return node


class Str(Kind):
    """A string, optionally with a minimum length or a pattern it must match whole."""

    expected = "a string"

    def __init__(self, pattern: str | None = None, min_length: int | None = None) -> None:
        self.pattern = pattern
        self.regex = re.compile(pattern) if pattern else None
        self.min_length = min_length

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, str):
            issues.append(Issue(path, "type", self.expected, value))
        elif self.min_length is not None and len(value) < self.min_length:
            issues.append(Issue(path, "range", f"at least {self.min_length} character(s) long", value))
        elif self.regex is not None and not self.regex.fullmatch(value):
            issues.append(Issue(path, "form", f"matching `{self.pattern}`", value))
        else:
            return value
        return BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "string"}
        if self.min_length is not None:
            node["minLength"] = self.min_length
        if self.pattern:
            node["pattern"] = self.pattern
        return node


class Bool(Kind):
    """true or false (YAML booleans only; 0/1 and strings refused)."""

    expected = "true or false"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if isinstance(value, bool):
            return value
        issues.append(Issue(path, "type", self.expected, value))
        return BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return {"type": "boolean"}


class Choice(Kind):
    """One of a fixed set of values (compared with their type: `true` is not `1`)."""

    def __init__(self, *values: str | int) -> None:
        self.values = values
        self.options = tuple(str(v) for v in values)
        self.expected = " or ".join(f"`{v}`" for v in values)

    def accepts(self, value: Any) -> bool:
        return any(type(value) is type(v) for v in self.values)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if any(type(value) is type(v) and value == v for v in self.values):
            return value
        issues.append(Issue(path, "choice", "", value, self.options))
        return BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        kind = "integer" if all(isinstance(v, int) for v in self.values) else "string"
        if len(self.values) == 1:
            return {"const": self.values[0], "type": kind}
        return {"enum": list(self.values), "type": kind}


class Optional(Kind):
    """The inner kind, or null (absent)."""

    def __init__(self, inner: Kind) -> None:
        self.inner = inner
        self.expected = inner.expected

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        return None if value is None else self.inner.check(value, path, issues)

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [self.inner.schema(defs), {"type": "null"}]}

    def sections(self) -> Iterator[type[Section]]:
        return self.inner.sections()


class AnyOf(Kind):
    """The first member that takes the value; a failure is reported once, as the member that applies."""

    def __init__(self, *members: Kind, expected: str | None = None,
                 schema: dict[str, Any] | None = None) -> None:
        self.members = members
        self.expected = expected or " or ".join(m.expected for m in members)
        self._schema = schema

    def accepts(self, value: Any) -> bool:
        return any(m.accepts(value) for m in self.members)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        trials: list[list[Issue]] = []
        for member in self.members:
            trials.append([])
            out = member.check(value, path, trials[-1])
            if not trials[-1]:
                return out
        typed = [i for i, m in enumerate(self.members) if m.accepts(value)]
        if len(typed) == 1 and not isinstance(self.members[typed[0]], Choice):
            # The value has this member's type and fails on a bound or an item: that is the mistake.
            alt = " or ".join(m.expected for i, m in enumerate(self.members) if i != typed[0])
            issues += [
                i._replace(expected=f"{i.expected} or {alt}") if i.path == path and i.kind == "range" else i
                for i in trials[typed[0]]
            ]
            return BAD
        choices = [m for m in self.members if isinstance(m, Choice)]
        if choices and isinstance(value, str):
            rest = "".join(f", or {m.expected}" for m in self.members if not isinstance(m, Choice))
            issues.append(Issue(path, "choice", rest, value, tuple(o for c in choices for o in c.options)))
            return BAD
        issues.append(Issue(path, "type", self.expected, value))
        return BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return dict(self._schema) if self._schema else {"anyOf": [m.schema(defs) for m in self.members]}

    def sections(self) -> Iterator[type[Section]]:
        for m in self.members:
            yield from m.sections()


class _Items(Kind):
    """A YAML list (a Python list or tuple): checked item by item, with the item's index in the path."""

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (list, tuple))

    def _each(self, kinds: Iterable[Kind], value: Any, path: Path, issues: list[Issue]) -> list[Any] | None:
        before = len(issues)
        out = [kind.check(item, (*path, i), issues) for i, (kind, item) in enumerate(zip(kinds, value))]
        return out if len(issues) == before else None


class ListOf(_Items):
    """A list whose every item is of the inner kind."""

    def __init__(self, inner: Kind) -> None:
        self.inner = inner
        self.expected = f"a list of {inner.expected.removeprefix('an ').removeprefix('a ')}s"

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not self.accepts(value):
            issues.append(Issue(path, "type", self.expected, value))
            return BAD
        out = self._each(repeat(self.inner), value, path, issues)
        return BAD if out is None else out

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return {"type": "array", "items": self.inner.schema(defs)}

    def sections(self) -> Iterator[type[Section]]:
        return self.inner.sections()


class TupleOf(_Items):
    """A fixed number of items, each of its own kind (written as a YAML list; stored as a tuple)."""

    def __init__(self, *items: Kind) -> None:
        self.items = items
        self.expected = f"a list of {len(items)} items"

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not self.accepts(value):
            issues.append(Issue(path, "type", self.expected, value))
            return BAD
        if len(value) < len(self.items):
            issues.append(Issue(path, "too_few", str(len(self.items)), value))
            return BAD
        if len(value) > len(self.items):
            issues.append(Issue(path, "range", f"a list of at most {len(self.items)} items", value))
            return BAD
        out = self._each(self.items, value, path, issues)
        return BAD if out is None else tuple(out)

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        # Draft-07 tuple form (what yaml-language-server reads), not 2020-12's `prefixItems`.
        n = len(self.items)
        return {"type": "array", "items": [k.schema(defs) for k in self.items], "additionalItems": False,
                "minItems": n, "maxItems": n}


class MappingOf(Kind):
    """A mapping with string keys; values of the given kind, or anything when it is None."""

    expected = "a mapping of keys"

    def __init__(self, values: Kind | None = None) -> None:
        self.values = values

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, dict):
            issues.append(Issue(path, "type", self.expected, value))
            return BAD
        before = len(issues)
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                issues.append(Issue((*path, str(key)), "type", "a string key", key))
                continue
            out[key] = item if self.values is None else self.values.check(item, (*path, key), issues)
        return out if len(issues) == before else BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        extra = True if self.values is None else self.values.schema(defs)
        return {"type": "object", "additionalProperties": extra}


class Nested(Kind):
    """A section: a mapping with the section's keys."""

    expected = "a mapping of keys"

    def __init__(self, section: type[Section]) -> None:
        self.section = section

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        return self.section._from_data(value, path, issues)

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        name = self.section.__name__
        if name not in defs:
            defs[name] = {}  # placeholder first: a section that (indirectly) holds itself terminates
            defs[name] = self.section._schema_body(defs)
        return {"$ref": f"#/definitions/{name}"}

    def sections(self) -> Iterator[type[Section]]:
        yield self.section


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class Field:
    """One key of a section: its kind, default (or REQUIRED), description and the key written in YAML."""

    __slots__ = ("alias", "default", "description", "factory", "kind", "name")

    def __init__(self, kind: Kind, default: Any, description: str, alias: str | None,
                 factory: Callable[[], Any] | None) -> None:
        self.kind, self.default, self.description = kind, default, description
        self.alias, self.factory, self.name = alias, factory, ""

    @property
    def key(self) -> str:
        """The key as written in a job file."""
        return self.alias or self.name

    @property
    def required(self) -> bool:
        """True when the key has no default."""
        return self.default is REQUIRED and self.factory is None

    def make_default(self) -> Any:
        """A fresh default value (a factory runs each time, so no two sections share a list)."""
        return self.factory() if self.factory is not None else self.default


def field(kind: Kind, default: Any = REQUIRED, description: str = "", *, alias: str | None = None,
          factory: Callable[[], Any] | None = None) -> Any:
    """Declare a section key (typed ``Any`` so the class annotation gives the attribute's static type)."""
    return Field(kind, default, description, alias, factory)


def section(cls: type[Section], description: str = "") -> Any:
    """Declare a nested section key that defaults to the section with all its defaults."""
    return Field(Nested(cls), REQUIRED, description, None, lambda: cls.model_validate({}))


def _plain(value: Any, json_mode: bool, by_alias: bool) -> Any:
    if isinstance(value, Section):
        return value.model_dump(mode="json" if json_mode else "python", by_alias=by_alias)
    if isinstance(value, (list, tuple)):
        items = [_plain(v, json_mode, by_alias) for v in value]
        return items if json_mode or isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _plain(v, json_mode, by_alias) for k, v in value.items()}
    return value


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(field, section))
class Section:
    """Base of every section: declared keys only (unknown keys are mistakes), frozen once built."""

    model_fields: ClassVar[dict[str, Field]] = {}
    _by_key: ClassVar[dict[str, Field]] = {}
    _plan: ClassVar[tuple[tuple[str, str, Kind, bool, Field], ...]] = ()
    model_fields_set: frozenset[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = dict(cls.model_fields)
        for name, value in list(vars(cls).items()):
            if isinstance(value, Field):
                value.name = name
                fields[name] = value
                delattr(cls, name)  # the instance's own attribute holds the value
        cls.model_fields = fields
        cls._by_key = {**{f.name: f for f in fields.values()}, **{f.key: f for f in fields.values()}}
        # Precomputed once per class: validating a job walks these tuples ~15 times (one per section).
        cls._plan = tuple((f.name, f.key, f.kind, f.required, f) for f in fields.values())

    def __init__(self, **data: Any) -> None:
        issues: list[Issue] = []
        values = type(self)._values(data, (), issues)
        if not issues:
            type(self)._relations(values, (), issues)
        if issues:
            raise SpecError(issues)
        self._fill(values, self._given(data))

    @classmethod
    def model_validate(cls, data: Any) -> Any:
        """A section built from plain data (a YAML/JSON mapping); raises SpecError listing every mistake."""
        issues: list[Issue] = []
        out = cls._from_data(data, (), issues)
        if issues:
            raise SpecError(issues)
        return out

    @classmethod
    def _from_data(cls, data: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(data, dict):
            issues.append(Issue(path, "type", "a mapping of keys", data))
            return BAD
        before = len(issues)
        values = cls._values(data, path, issues)
        if len(issues) == before:
            cls._relations(values, path, issues)
        if len(issues) != before:
            return BAD
        obj = cls.__new__(cls)
        obj._fill(values, cls._given(data))
        return obj

    @classmethod
    def _given(cls, data: dict[str, Any]) -> frozenset[str]:
        """Names of the fields ``data`` wrote (under their YAML key or their attribute name)."""
        return frozenset(cls._by_key[k].name for k in data)

    @classmethod
    def _values(cls, data: dict[Any, Any], path: Path, issues: list[Issue]) -> dict[str, Any]:
        by_key = cls._by_key
        for key in data:
            if not isinstance(key, str) or key not in by_key:
                issues.append(Issue((*path, str(key)), "unknown", "", key, tuple(p[1] for p in cls._plan)))
        values: dict[str, Any] = {}
        for name, key, kind, required, f in cls._plan:
            if key in data:
                values[name] = kind.check(data[key], (*path, key), issues)
            elif name in data:
                values[name] = kind.check(data[name], (*path, key), issues)
            elif required:
                issues.append(Issue((*path, key), "missing"))
            else:
                values[name] = f.make_default()
        return values

    @classmethod
    def _relations(cls, values: dict[str, Any], path: Path, issues: list[Issue]) -> None:
        """Checks between keys of this section (their values already checked one by one); appends issues."""

    def _fill(self, values: dict[str, Any], given: frozenset[str]) -> None:
        d = self.__dict__
        d.update(values)
        d["model_fields_set"] = given

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenSpecError(f"{type(self).__name__} is frozen: build a "
                              f"changed copy with model_copy(update=...)")

    def __delattr__(self, name: str) -> None:
        raise FrozenSpecError(f"{type(self).__name__} is frozen")

    def model_copy(self, update: dict[str, Any] | None = None) -> Any:
        """A copy with ``update``'s values replacing fields (not re-checked: the caller's values are
        typed)."""
        update = update or {}
        unknown = set(update) - set(self.model_fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        new = type(self).__new__(type(self))
        new._fill({**self._field_values(), **update}, self.model_fields_set | frozenset(update))
        return new

    def _field_values(self) -> dict[str, Any]:
        return {name: self.__dict__[name] for name in self.model_fields}

    def model_dump(self, mode: str = "python", by_alias: bool = False) -> dict[str, Any]:
        """Plain data: nested sections as dicts; with mode="json" tuples become lists."""
        return {(f.key if by_alias else f.name): _plain(self.__dict__[f.name], mode == "json", by_alias)
                for f in self.model_fields.values()}

    @classmethod
    def _schema_body(cls, defs: dict[str, Any]) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for f in cls.model_fields.values():
            node = f.kind.schema(defs)
            if f.description:
                node["description"] = f.description
            if f.default is not REQUIRED:
                node["default"] = _plain(f.default, True, True)
            elif f.factory is not None and not isinstance(f.kind, Nested):
                node["default"] = _plain(f.factory(), True, True)
            if "$ref" in node and len(node) > 1:  # draft-07 ignores every key beside `$ref`: wrap the
                                                  # reference
                node = {"allOf": [{"$ref": node.pop("$ref")}], **node}
            props[f.key] = node
        body: dict[str, Any] = {"type": "object", "additionalProperties": False,
                                "description": " ".join((cls.__doc__ or "").split()), "properties": props}
        required = [f.key for f in cls.model_fields.values() if f.required]
        if required:
            body["required"] = required
        return body

    @classmethod
    def model_json_schema(cls) -> dict[str, Any]:
        """This section as a JSON Schema (draft-07), nested sections under `definitions` by class name."""
        defs: dict[str, Any] = {}
        body = cls._schema_body(defs)
        defs.pop(cls.__name__, None)
        return {**body, "definitions": dict(sorted(defs.items()))}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._field_values() == other._field_values()

    def __hash__(self) -> int:
        return hash((type(self), _hashable(self._field_values())))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._field_values().items())
        return f"{type(self).__name__}({shown})"
