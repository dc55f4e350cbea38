"""Load one YAML job file into plain data plus the line and column of every key and value.

Plain PyYAML silently keeps the last of two duplicate keys, builds arbitrary objects from
tags and expands aliases without bound; a job file is configuration written by a person,
so each of those is an error here, pointing at the line where it happens.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from dsforge.compiler.frontend.inline_ignores import InlineIgnore, scan_comments
from dsforge.diagnostics import Diagnostic, InputError, Location, Severity

try:  # the C loader composes about 10x faster; marks are the same
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - pure-Python PyYAML
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

Path_ = tuple[str | int, ...]

#: Bounds that keep a hostile file from exhausting memory ("billion laughs").
MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_NODES = 100_000
MAX_DEPTH = 64
#: Longest integer literal read: Python refuses more than 4,300 digits, and up to 300 digits a number still
#: converts to a float (1e308 is the largest) wherever a check compares it; a size needs at most 20.
MAX_NUMBER_DIGITS = 300

#: The file argument that means standard input (CI pipes a generated job in), and how diagnostics name it.
STDIN = "-"
STDIN_NAME = "<stdin>"

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
_MERGE = _CORE + "merge"
_scalars = yaml.constructor.SafeConstructor()


@dataclass
class SourceMap:
    """Where each key path of the document was written: the key's position and its value's."""

    file: str
    keys: dict[Path_, Location] = field(default_factory=dict)
    values: dict[Path_, Location] = field(default_factory=dict)
    #: `# dsforge: ignore[...]` comments of this file and of the files it extends
    #: (dsforge/compiler/rules/selection.py).
    ignores: list[InlineIgnore] = field(default_factory=list)

    def locate(self, path: Path_, value: bool = False) -> Location:
        """The best location for ``path``: itself, else its nearest written ancestor."""
        table = self.values if value else self.keys
        for cut in range(len(path), 0, -1):
            loc = table.get(path[:cut]) or self.keys.get(path[:cut])
            if loc is not None:
                return loc
        return Location(self.file, 1, 1)

    def overlay(self, other: SourceMap) -> None:
        """Take ``other``'s positions where it has them (it was merged on top)."""
        self.keys.update(other.keys)
        self.values.update(other.values)
        self.ignores.extend(other.ignores)


def _fail(rule: str, msg: str, loc: Location, fix: str) -> InputError:
    return InputError([Diagnostic(rule, Severity.ERROR, msg, loc, fix)])


def is_stdin(path: str | Path) -> bool:
    """True when ``path`` is the conventional `-` that names standard input."""
    return str(path) == STDIN


def read_text(path: Path, display: str) -> str:
    """Read a job file as UTF-8 text, rejecting missing, huge, binary and empty files and anything not a
    regular file.

    The file is opened without blocking (a FIFO with no writer would otherwise hang the open), its
    kind and size come from fstat before a byte is read, and at most MAX_FILE_BYTES + 1 bytes are ever
    read: a device such as /dev/zero, a pipe or a 3 GB sparse file costs one system call, not memory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise _fail("DSF001", f"file {display} does not exist", Location(display),
                    "check the path (`-` reads the job from standard input)") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise _fail("DSF001", f"cannot open {display}: {_reason(exc)}", Location(display),
                    "check the path and its permissions") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise _fail("DSF001", f"{display} is a directory, not a job file", Location(display),
                        "name the YAML job file inside it")
        if not stat.S_ISREG(info.st_mode):
            raise _fail("DSF001", f"{display} is not a regular file (it is {_kind(info.st_mode)})",
                        Location(display), "give the path of a job file; to read a pipe, "
                        "pass `-` and redirect it to standard input")
        if info.st_size > MAX_FILE_BYTES:
            raise _fail("DSF007", f"file is {info.st_size} bytes, over the "
                                  f"{MAX_FILE_BYTES}-byte limit for a job file",
                        Location(display), "a job file describes one job; split data out of it")
        raw = _read_at_most(fd, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise _fail("DSF001", f"cannot read {display}: {_reason(exc)}", Location(display),
                    "check the path and its permissions") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:  # it grew after fstat
        raise _fail("DSF007", f"file is over the {MAX_FILE_BYTES}-byte limit for a job file",
                    Location(display), "a job file describes one job; split data out of it")
    return decode_text(raw, display)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO or pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "another kind of file")


def read_stream(stream: BinaryIO | None, display: str = STDIN_NAME) -> str:
    """Read a job file from a byte stream (standard input) with the checks of ``read_text``.

    At most MAX_FILE_BYTES + 1 bytes are read: a pipe has no size to check first, and one byte over
    the limit is enough to refuse it without buffering whatever the writer would go on sending.
    """
    if stream is None:  # the interpreter was started with standard input closed
        raise _fail("DSF001", "standard input is closed; there is no job to read", Location(display),
                    "pipe the job file in (`dsforge validate - < job.yaml`) or name the file")
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= MAX_FILE_BYTES:
            chunk = stream.read(MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _fail("DSF001", f"cannot read standard input: {exc.strerror or exc}", Location(display),
                    "pipe the job file in, or name the file") from None
    if size > MAX_FILE_BYTES:
        raise _fail("DSF007",
                    f"standard input holds more than the {MAX_FILE_BYTES}-byte limit for a job file",
                    Location(display), "a job file describes one job; split data out of it")
    return decode_text(b"".join(chunks), display)


def decode_text(raw: bytes, display: str) -> str:
    """Job-file bytes as text, rejecting non-UTF-8 bytes, an empty document and tab indentation."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _fail("DSF002", f"byte 0x{raw[exc.start]:02x} is not valid UTF-8",
                    Location(display, line, col), "save the file as UTF-8") from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise _fail("DSF008", "the file is empty: a job file must be a mapping with at least `version: 1`",
                    Location(display, 1, 1), "start from an example in examples/, "
                                             "`dsforge init` or `dsforge schema`")
    for no, row in enumerate(text.splitlines(), 1):
        indent = row[: len(row) - len(row.lstrip(" \t"))]
        if "\t" in indent:
            raise _fail("DSF003", "a tab is used for indentation; YAML allows only spaces there",
                        Location(display, no, indent.index("\t") + 1), "replace the tab with spaces")
    return text


def _loc(display: str, mark: Any) -> Location:
    return Location(display, mark.line + 1, mark.column + 1)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _too_big(display: str, node: yaml.Node) -> InputError:
    return _fail("DSF007", f"the document expands to more than {MAX_NODES} values (aliases repeated inside "
                 "aliases?)", _loc(display, node.start_mark),
                 "write the values out instead of nesting aliases")


def _too_deep(display: str, node: yaml.Node) -> InputError:
    return _fail("DSF007", f"the document nests deeper than {MAX_DEPTH} levels",
                 _loc(display, node.start_mark), "flatten the structure; a job file needs a few levels")


def check_bounds(root: yaml.Node, display: str) -> None:
    """Reject alias bombs, recursive aliases and deep nesting before any value is built.

    An alias reuses its anchor's node, so the composed graph stays small while its expansion can be
    9^9 values ("billion laughs"). Sizes and heights are memoised per node, so this pass costs one
    visit per distinct node however large the expansion would be; depth is checked on the way down,
    so the recursion never goes deeper than MAX_DEPTH.
    """
    memo: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()

    def measure(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in open_nodes:
            raise _fail("DSF007", "an alias refers to the anchor that contains it (a recursive structure)",
                        _loc(display, node.start_mark), "write the values out instead of the recursive alias")
        if depth > MAX_DEPTH or (key in memo and depth + memo[key][1] > MAX_DEPTH):
            raise _too_deep(display, node)
        if key in memo:
            return memo[key]
        open_nodes.add(key)
        size, height = 1, 0
        for child in _children(node):
            child_size, child_height = measure(child, depth + 1)
            size, height = size + child_size, max(height, child_height + 1)
            if size > MAX_NODES:
                raise _too_big(display, node)
        open_nodes.discard(key)
        memo[key] = (size, height)
        return size, height

    measure(root, 0)


class _Builder:
    """Turns a composed (and bounds-checked) node graph into Python data, recording positions."""

    def __init__(self, display: str):
        self.display = display
        self.smap = SourceMap(display)
        self.count = 0

    def build(self, node: yaml.Node, path: Path_, depth: int) -> Any:
        # Bounds for documents without anchors, where check_bounds is skipped (libyaml itself stops at
        # 1,000 levels, deeper than Python's recursion limit allows here).
        self.count += 1
        if depth > MAX_DEPTH:
            raise _too_deep(self.display, node)
        if self.count > MAX_NODES:
            raise _too_big(self.display, node)
        self.smap.values.setdefault(path, _loc(self.display, node.start_mark))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            self._check_tag(node, _CORE + "seq")
            return [self.build(child, path + (i,), depth + 1) for i, child in enumerate(node.value)]
        self._check_tag(node, None)
        if node.tag == _CORE + "timestamp":
            return str(node.value)
        return self._scalar(node)

    def _scalar(self, node: yaml.Node) -> Any:
        """The scalar's value; a tag its text does not fit (`!!int abc`) or a number too long to read is an
        error."""
        text = str(node.value)
        if node.tag == _CORE + "int" and len(text) > MAX_NUMBER_DIGITS:
            # past 4,300 digits int() raises (CVE-2020-10735); past ~309 a number no longer fits a float
            raise _fail("DSF007", f"a number of {len(text)} characters is over the "
                        f"{MAX_NUMBER_DIGITS}-character limit for a number in a job file",
                        _loc(self.display, node.start_mark),
                        "write the number with fewer digits (a size in a job file needs at most 20)")
        try:
            return _scalars.construct_object(node)
        except (ValueError, KeyError, IndexError, TypeError, OverflowError, yaml.YAMLError):
            tag = str(node.tag).removeprefix(_CORE)
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise _fail("DSF006", f"{shown!r} is not a valid {tag}: the tag `!!{tag}` cannot read it",
                        _loc(self.display, node.start_mark),
                        f"remove the tag `!!{tag}` or write a value of that type") from None

    def _check_tag(self, node: yaml.Node, container: str | None) -> None:
        ok = node.tag == container if container else node.tag in _SCALAR_TAGS
        if not ok:
            raise _fail("DSF006", f"tag {node.tag!r} is not allowed: a job file holds only plain mappings, "
                        "lists, strings, numbers, booleans and null",
                        _loc(self.display, node.start_mark), "remove the tag")

    def _mapping(self, node: yaml.MappingNode, path: Path_, depth: int) -> dict[str, Any]:
        self._check_tag(node, _CORE + "map")
        out: dict[str, Any] = {}
        merges: list[yaml.Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                merges += value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in _SCALAR_TAGS:
                raise _fail("DSF006", "a mapping key must be a plain string",
                            _loc(self.display, key_node.start_mark), "write the key as a plain word")
            key = str(key_node.value)
            kloc = _loc(self.display, key_node.start_mark)
            if key in out:
                first = self.smap.keys[path + (key,)]
                raise _fail("DSF005", f"key `{key}` appears twice in the same mapping (first at line "
                            f"{first.line}); YAML would silently keep the last one", kloc,
                            "delete one of the two")
            self.smap.keys[path + (key,)] = kloc
            out[key] = self.build(value_node, path + (key,), depth + 1)
        return {**self._merged(merges, path, depth, set(out)), **out}

    def _merged(self, sources: list[yaml.Node], path: Path_, depth: int,
                explicit: set[str]) -> dict[str, Any]:
        """The `<<` merge keys' mappings (YAML 1.1: explicit keys win, then earlier sources over later)."""
        merged: dict[str, Any] = {}
        for src in sources:
            sub = _Builder(self.display)  # its own map, so only the keys that take effect keep positions
            data = sub.build(src, path, depth + 1)
            if not isinstance(data, dict):
                raise _fail("DSF006", "a `<<` merge key must name a mapping",
                            _loc(self.display, src.start_mark), "point `<<` at a mapping anchor")
            new = {k for k in data if k not in explicit and k not in merged}
            for theirs, mine in ((sub.smap.keys, self.smap.keys), (sub.smap.values, self.smap.values)):
                mine.update({p: loc for p,
                             loc in theirs.items() if len(p) > len(path) and p[len(path)] in new})
            merged.update({k: data[k] for k in new})
        return merged


def load_yaml(text: str, display: str) -> tuple[dict[str, Any], SourceMap]:
    """Parse YAML text into a mapping plus its source map, or raise InputError."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        from dsforge.compiler.yaml_flow import unclosed_flow

        flow = unclosed_flow(exc, display)  # an open `[` / `{`: named where it opened and where the parser
                                            # gave up
        if flow is not None:
            raise _fail("DSF004", flow[0], flow[1], flow[2]) from None
        mark = exc.problem_mark or exc.context_mark
        loc = _loc(display, mark) if mark is not None else Location(display, 1, 1)
        problem = (exc.problem or exc.context or "invalid YAML").strip()
        raise _fail("DSF004", f"YAML syntax error: {problem}", loc,
                    "check indentation, colons and quotes around this position") from None
    except yaml.reader.ReaderError as exc:  # a character YAML forbids; it carries an offset, not a mark
        before = text[: exc.position]
        loc = Location(display, before.count("\n") + 1, exc.position - (before.rfind("\n") + 1) + 1)
        raise _fail("DSF004", f"character U+{exc.character:04X} is not allowed in YAML ({exc.reason})", loc,
                    "delete the character or write it as an escape inside a double-quoted string") from None
    except yaml.YAMLError as exc:
        raise _fail("DSF004", f"YAML syntax error: {exc}", Location(display, 1, 1),
                    "check the file's YAML syntax") from None
    if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _CORE + "null" and not node.value):
        raise _fail("DSF008", "the document is empty", Location(display, 1, 1),
                    "add `version: 1` and a model")
    if "&" in text:  # only an anchor makes aliases (and so exponential expansion) possible
        check_bounds(node, display)
    builder = _Builder(display)
    data = builder.build(node, (), 0)
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(data), "null")
        raise _fail("DSF009", f"the top level is {kind}; a job file must be a mapping of sections",
                    _loc(display, node.start_mark), "start the file with `version: 1` "
                                                    "and sections such as `model:`")
    if "dsforge:" in text:  # suppression comments are rare: scan only files that may hold one
        builder.smap.ignores = scan_comments(text, display)
    return data, builder.smap
