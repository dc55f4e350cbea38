"""`dsforge search --write`: the job file with each `auto` the search resolved replaced by its value, in place.

The file is edited as text at the positions the loader recorded, so its comments, key order, quoting and flow
or block style stay as written; only the `auto` tokens (and a global batch the search chose) change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsforge.compiler.parse import LoadedJob
from dsforge.compiler.search.space import AUTO, Layout

#: Where each key's chosen value comes from in a Layout.
FIELD_OF: dict[tuple[str, ...], str] = {
    ("parallel", "tp"): "tp", ("parallel", "pp"): "pp", ("parallel", "dp"): "dp", ("parallel", "cp"): "cp",
    ("parallel", "ep"): "ep", ("parallel", "zero"): "zero", ("parallel", "sequence_parallel"): "sequence_parallel",
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


def _raw_at(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def replacements(job: LoadedJob, lay: Layout) -> list[tuple[tuple[str, ...], int, int, str, str]]:
    """(key, line, column, old text, new text) of every value `--write` changes."""
    out = []
    for path, attr in FIELD_OF.items():
        written = _raw_at(job.raw, path)
        new = getattr(lay, attr)
        if path == ("training", "global_batch"):
            if written == new or (written is None and new == job.spec.training.global_batch):
                continue
            if written is None:
                raise WriteError(f"the search chose training.global_batch: {new}, which {job.source.file} does not "
                                 "write: add the key (any value) for --write to set it")
        elif written != AUTO:
            continue
        loc = job.source.values.get(path)
        if loc is None or Path(loc.file).resolve() != Path(job.source.file).resolve():
            where = loc.file if loc is not None else "a file it extends"
            raise WriteError(f"{'.'.join(path)}: `{written}` is written in {where}, not in {job.source.file}; "
                             "set it there, or override it in this file")
        out.append((path, loc.line, loc.column, yaml_value(written), yaml_value(new)))
    return out


def rewrite_text(text: str, job: LoadedJob, lay: Layout) -> str:
    """The job file's text with the search's values in place of its `auto` values."""
    lines = text.splitlines(keepends=True)
    # right to left within a line, so earlier columns stay valid (flow mappings hold several on one line)
    for path, line, col, old, new in sorted(replacements(job, lay), key=lambda r: (r[1], -r[2])):
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
    return "".join(lines)


def write_job(job: LoadedJob, lay: Layout, target: str | Path) -> Path:
    """Write the rewritten job file to ``target`` (its own directory keeps `extends:` and relative paths valid
    when it lies beside the original)."""
    source = Path(job.source.file)
    text = rewrite_text(source.read_text(encoding="utf-8"), job, lay)
    out = Path(target)
    out.write_text(text, encoding="utf-8")
    return out
