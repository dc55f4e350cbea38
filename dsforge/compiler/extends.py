"""Resolve `extends:`: base files merged underneath the including file.

Mappings merge deeply and lists replace, so a child can override one key of a section
without restating the rest. Paths are relative to the including file (to the working directory
for a job read from standard input); a cycle or a missing file is an error that names the whole chain.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

from dsforge.compiler.source import STDIN_NAME, SourceMap, is_stdin, load_yaml, read_stream, read_text
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


def load_document(path: str | Path, stdin: BinaryIO | None = None) -> tuple[dict[str, Any], SourceMap]:
    """Load a job file with its `extends:` chain merged underneath, or raise InputError.

    ``path`` `-` reads the job from ``stdin`` (default: this process's standard input); its
    diagnostics name it `<stdin>` and its `extends:` paths are relative to the working directory.
    """
    if is_stdin(path):
        stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
        data, smap = load_yaml(read_stream(stream), STDIN_NAME)
        return _with_bases(data, smap, Path.cwd(), [], [STDIN_NAME], "the working directory")
    return _load(Path(path), [])


def _load(path: Path, chain: list[Path]) -> tuple[dict[str, Any], SourceMap]:
    display = _display(path)
    data, smap = load_yaml(read_text(path, display), display)
    here = chain + [path.resolve()]
    return _with_bases(data, smap, path.parent, here, [_display(p) for p in here], display)


def _with_bases(data: dict[str, Any], smap: SourceMap, folder: Path, here: list[Path], trail: list[str],
                relative_to: str) -> tuple[dict[str, Any], SourceMap]:
    """Merge the files ``data`` extends underneath it; ``here`` is the chain of files already open."""
    display = smap.file
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
    for name in names:
        target = (folder / name).resolve()
        shown = " -> ".join([*trail, _display(target)])
        if target in here:
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` forms a cycle: {shown}", loc,
                                         "remove one link of the chain", ("extends",))])
        if len(trail) >= MAX_CHAIN:
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` chain is deeper than {MAX_CHAIN}: {shown}", loc,
                                         "flatten the chain", ("extends",))])
        if not target.is_file():
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` names a file that does not exist: {shown}", loc,
                                         f"create {name} or fix the path (it is relative to {relative_to})",
                                         ("extends",))])
        base, bsmap = _load(target, here)
        merged = deep_merge(merged, base)
        msmap.overlay(bsmap)
    msmap.overlay(smap)
    msmap.file = display
    return deep_merge(merged, data), msmap
