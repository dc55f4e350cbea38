"""Resolve `extends:`: base files merged underneath the including file.

Mappings merge deeply and lists replace, so a child can override one key of a section
without restating the rest. Paths are relative to the including file; a cycle or a missing
file is an error that names the whole chain.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dsforge.compiler.source import SourceMap, load_yaml, read_text
from dsforge.diagnostics import Diagnostic, InputError, Severity

MAX_CHAIN = 16


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge ``top`` over ``base``: mappings recursively, every other value (lists too) replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _display(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return rel if not rel.startswith("..") else str(path)


def load_document(path: str | Path) -> tuple[dict[str, Any], SourceMap]:
    """Load a job file with its `extends:` chain merged underneath, or raise InputError."""
    return _load(Path(path), [])


def _load(path: Path, chain: list[Path]) -> tuple[dict[str, Any], SourceMap]:
    display = _display(path)
    data, smap = load_yaml(read_text(path, display), display)
    parents = data.pop("extends", None)
    if parents is None:
        return data, smap
    names = [parents] if isinstance(parents, str) else parents
    loc = smap.locate(("extends",), value=True)
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise InputError([Diagnostic("DSF010", Severity.ERROR, "`extends` must be a file name or a list of file names",
                                     loc, "write `extends: base.yaml`", ("extends",))])
    merged: dict[str, Any] = {}
    msmap = SourceMap(display)
    here = chain + [path.resolve()]
    for name in names:
        target = (path.parent / name).resolve()
        trail = " -> ".join(_display(p) for p in here + [target])
        if target in here:
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` forms a cycle: {trail}", loc,
                                         "remove one link of the chain", ("extends",))])
        if len(here) >= MAX_CHAIN:
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` chain is deeper than {MAX_CHAIN}: {trail}", loc,
                                         "flatten the chain", ("extends",))])
        if not target.is_file():
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` names a file that does not exist: {trail}", loc,
                                         f"create {name} or fix the path (it is relative to {display})",
                                         ("extends",))])
        base, bsmap = _load(target, here)
        merged = deep_merge(merged, base)
        msmap.overlay(bsmap)
    msmap.overlay(smap)
    msmap.file = display
    return deep_merge(merged, data), msmap
