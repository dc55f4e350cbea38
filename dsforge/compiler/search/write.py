"""`dsforge search --write`: the job file with each `auto` the search resolved replaced by its value, in
place.

The file is edited as text at the positions the loader recorded, so its comments, key order, quoting and flow
or block style stay as written; only the `auto` tokens (and a global batch the search chose) change. An `auto`
(or a global batch) the file does not write itself, because it comes from a file named in `extends:`, is
written into the job file as an override: into the section that holds it when the file has one (block or flow
style, as the section is written), else as a new section at the end; the file it extends is never touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.job_paths import written_value
from dsforge.compiler.frontend.parse import LoadedJob
from dsforge.compiler.frontend.source import SourceMap, load_yaml
from dsforge.compiler.search.space import AUTO, Layout

#: Where each key's chosen value comes from in a Layout.
FIELD_OF: dict[tuple[str, ...], str] = {
    ("parallel", "tp"): "tp", ("parallel", "pp"): "pp", ("parallel", "dp"): "dp", ("parallel", "cp"): "cp",
    ("parallel", "ep"): "ep", ("parallel", "zero"): "zero",
    ("parallel", "sequence_parallel"): "sequence_parallel",
    ("parallel", "context_parallel", "kind"): "cp_kind", ("parallel", "pipeline", "schedule"): "schedule",
    ("parallel", "pipeline", "virtual_stages"): "virtual_stages", ("training", "micro_batch"): "micro_batch",
    ("training", "recompute"): "recompute", ("hardware", "nodes"): "nodes",
    ("training", "global_batch"): "global_batch",
}


class WriteError(ValueError):
    """The job file cannot be rewritten in place (an `auto` written in a file it extends)."""


def yaml_value(value: Any) -> str:
    """A value as YAML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_ABSENT = object()


def _has(raw: dict[str, Any], path: tuple[str, ...]) -> bool:
    return written_value(raw, path, _ABSENT) is not _ABSENT


def _needed(job: LoadedJob, lay: Layout) -> list[tuple[tuple[str, ...], Any, Any]]:
    """(key, value in effect, new value) of every key `--write` must set: each `auto`, and a global batch
    the search changed."""
    out: list[tuple[tuple[str, ...], Any, Any]] = []
    for path, attr in FIELD_OF.items():
        written, new = written_value(job.raw, path), getattr(lay, attr)
        if path == ("training", "global_batch"):
            if new != job.spec.training.global_batch:
                out.append((path, written, new))
        elif written == AUTO:
            out.append((path, written, new))
    return out


def _own(job: LoadedJob, text: str) -> tuple[dict[str, Any], SourceMap]:
    """The job file's own keys and positions, without the files it extends."""
    data, smap = load_yaml(text, job.source.file)
    data.pop("extends", None)
    return data, smap


def replacements(job: LoadedJob, lay: Layout,
                 text: str | None = None) -> list[tuple[tuple[str, ...], int, int, str, str]]:
    """(key, line, column, old text, new text) of every value `--write` changes where the file writes it."""
    text = text if text is not None else Path(job.source.file).read_text(encoding="utf-8")
    own, smap = _own(job, text)
    out = []
    for path, _, new in _needed(job, lay):
        if not _has(own, path):
            continue  # not written here: an override (`overrides`)
        loc = smap.values.get(path)
        if loc is None:
            raise WriteError(f"{'.'.join(path)}: no position recorded in {job.source.file}")
        out.append((path, loc.line, loc.column, yaml_value(written_value(own, path)), yaml_value(new)))
    return out


def overrides(job: LoadedJob, lay: Layout, text: str) -> dict[tuple[str, ...], Any]:
    """The keys `--write` must add to the job file (what a file it extends leaves `auto`), with their
    values."""
    own, _ = _own(job, text)
    return {path: new for path, _, new in _needed(job, lay) if not _has(own, path)}


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return yaml_value(value)


def _block(tree: dict[str, Any], indent: int) -> list[str]:
    lines = []
    for key, value in tree.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:\n")
            lines += _block(value, indent + 2)
        else:
            lines.append(" " * indent + f"{key}: {yaml_value(value)}\n")
    return lines


def _nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in pairs:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _closing_brace(lines: list[str], line: int, col: int) -> tuple[int, int]:
    """(line index, column index) of the `}` that closes the flow mapping opened at (line, col), 0-based."""
    depth, quote = 0, ""
    for i in range(line, len(lines)):
        row = lines[i]
        for j in range(col if i == line else 0, len(row)):
            ch = row[j]
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (j == 0 or row[j - 1] in " \t"):
                break  # a comment runs to the end of the line
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i, j
    raise WriteError(f"no closing brace for the mapping at line {line + 1}")


def _end_of_block(lines: list[str], key_line: int, indent: int) -> int:
    """The index of the last line of the block mapping whose key sits at ``key_line`` with ``indent``."""
    last = key_line
    for i in range(key_line + 1, len(lines)):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(lines[i]) - len(lines[i].lstrip()) <= indent:
            break
        last = i
    return last


def add_overrides(text: str, job: LoadedJob, values: dict[tuple[str, ...], Any]) -> str:
    """``text`` with each of ``values`` written into it: inside the deepest section of its key the file
    already writes (in that section's style), or as a new top-level section at the end."""
    if not values:
        return text
    own, smap = _own(job, text)
    groups: dict[tuple[str, ...], list[tuple[tuple[str, ...], Any]]] = {}
    for path, value in values.items():
        cut = 0  # the deepest section of the key the file writes
        while cut < len(path) - 1 and isinstance(written_value(own, path[:cut + 1]), dict):
            cut += 1
        if _has(own, path[:cut + 1]):
            raise WriteError(f"{'.'.join(path[:cut + 1])} in {job.source.file} is not a mapping, so "
                             f"{'.'.join(path)} cannot be written under it; write it there as a mapping")
        groups.setdefault(path[:cut], []).append((path[cut:], value))
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # (line index, column or -1 for a line inserted before it, new text); a new section goes after what else
    # is inserted at the end, so its column sorts highest
    edits: list[tuple[int, int, str]] = []
    for parent, pairs in groups.items():
        tree = _nest(pairs)
        if not parent:
            edits.append((len(lines), 1 << 30, "".join(_block(tree, 0))))
            continue
        at, key = smap.values.get(parent), smap.keys.get(parent)
        if at is None or key is None:
            raise WriteError(f"{'.'.join(parent)}: no position recorded in {job.source.file}")
        row = lines[at.line - 1]
        if row[at.column - 1:at.column] == "{":
            i, j = _closing_brace(lines, at.line - 1, at.column - 1)
            inner = lines[i][:j].rstrip()
            sep = "" if inner.endswith("{") else ", "
            edits.append((i, j, sep + _flow(tree)[1:-1]))
        else:
            end = _end_of_block(lines, key.line - 1, key.column - 1)
            edits.append((end + 1, -1, "".join(_block(tree, at.column - 1))))
    # bottom-up; on one line the edits inside it right to left, then a line inserted before it
    for index, col, new in sorted(edits, reverse=True):
        if col < 0 or index == len(lines):
            lines.insert(index, new)
        else:
            lines[index] = lines[index][:col] + new + lines[index][col:]
    return "".join(lines)


def rewrite_text(text: str, job: LoadedJob, lay: Layout) -> str:
    """The job file's text with the search's values in place of its `auto` values, and written as overrides
    where the `auto` comes from a file it extends."""
    lines = text.splitlines(keepends=True)
    # right to left within a line, so earlier columns stay valid (flow mappings hold several on one line)
    for path, line, col, old, new in sorted(replacements(job, lay, text), key=lambda r: (r[1], -r[2])):
        row = lines[line - 1]
        start = col - 1
        token = row[start:start + len(old)]
        quoted = row[start:start + len(old) + 2]
        if token == old:
            lines[line - 1] = row[:start] + new + row[start + len(old):]
        elif quoted in (f'"{old}"', f"'{old}'"):
            lines[line - 1] = row[:start] + new + row[start + len(old) + 2:]
        else:
            raise WriteError(f"{'.'.join(path)}: expected `{old}` at line {line}, column {col}")
    edited = "".join(lines)
    return add_overrides(edited, job, overrides(job, lay, text))
def write_job(job: LoadedJob, lay: Layout, target: str | Path) -> Path:
    """Write the rewritten job file to ``target`` (its own directory keeps `extends:` and relative paths valid
    when it lies beside the original)."""
    source = Path(job.source.file)
    text = rewrite_text(source.read_text(encoding="utf-8"), job, lay)
    out = Path(target)
    out.write_text(text, encoding="utf-8")
    return out
