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

from dsforge.compiler.frontend.source import (
    STDIN_NAME,
    SourceMap,
    is_stdin,
    load_yaml,
    read_stream,
    read_text,
)
from dsforge.diagnostics import Diagnostic, InputError, Location, Severity

MAX_CHAIN = 16
#: Longest `extends:` name taken (PATH_MAX on Linux; a longer one cannot name a file anyway).
MAX_NAME = 4096


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge ``top`` over ``base``: mappings recursively, every other value (lists too) replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def display_path(path: Path) -> str:
    """The path as diagnostics name files: relative to the working directory when below it."""
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


def _target(folder: Path, name: str, loc: Location, trail: list[str]) -> Path:
    """The absolute path ``name`` names; a name no file system can hold (a NUL byte, over the length limits)
    is DSF010."""
    shown = name if len(name) <= 80 else name[:77] + "..."
    problem = None
    if "\x00" in name:
        problem = "contains a NUL character"
    elif len(name) > MAX_NAME:
        problem = f"is {len(name)} characters long, over the {MAX_NAME}-character limit for a path"
    else:
        try:
            return (folder / name).resolve()
        except (OSError, ValueError, RuntimeError) as exc:  # a component too long, a symlink loop
            problem = f"cannot be resolved ({getattr(exc, 'strerror', None) or exc})"
    raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` name {shown!r} {problem}",
                                 loc, "name an existing base file by a plain path", ("extends",))])


def _exists(target: Path) -> bool:
    """True when something is at ``target`` (read_text then refuses what is not a regular file, naming its
    kind)."""
    try:
        return target.exists()
    except (OSError, ValueError):  # a name component over the file system's limit
        return False


def _load(path: Path, chain: list[Path]) -> tuple[dict[str, Any], SourceMap]:
    display = display_path(path)
    data, smap = load_yaml(read_text(path, display), display)
    here = chain + [path.resolve()]
    return _with_bases(data, smap, path.parent, here, [display_path(p) for p in here], display)


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
        raise InputError([Diagnostic("DSF010", Severity.ERROR,
                                     "`extends` must be a file name or a list of file names", loc,
                                     "write `extends: base.yaml`", ("extends",))])
    merged: dict[str, Any] = {}
    msmap = SourceMap(display)
    for name in names:
        target = _target(folder, name, loc, trail)
        shown = " -> ".join([*trail, display_path(target)])
        if target in here:
            raise InputError([Diagnostic("DSF010", Severity.ERROR, f"`extends` forms a cycle: {shown}", loc,
                                         "remove one link of the chain", ("extends",),
                                         {"extends_cycle": True})])
        if len(trail) >= MAX_CHAIN:
            raise InputError([Diagnostic("DSF010", Severity.ERROR,
                                         f"`extends` chain is deeper than {MAX_CHAIN}: {shown}", loc,
                                         "flatten the chain", ("extends",))])
        if not _exists(target):
            raise InputError([Diagnostic("DSF010", Severity.ERROR,
                                         f"`extends` names a file that does not exist: {shown}", loc,
                                             f"create {name} or fix the path (it "
                                             f"is relative to {relative_to})",
                                         ("extends",))])
        if not target.is_file():  # a directory, a FIFO, a device: said here, at the `extends` line
            raise InputError([Diagnostic("DSF010", Severity.ERROR,
                                         f"`extends` names something that is not a regular " f"file: {shown}",
                                         loc, f"name a YAML base file (relative to {relative_to})",
                                         ("extends",))])
        try:
            base, bsmap = _load(target, here)
        except InputError as exc:
            if len(trail) == 1:  # the job file itself (or standard input): its own `extends:` line is where
                                 # the chain starts
                from dsforge.compiler.extends_cycle import at_job_file

                raise at_job_file(exc, loc) from None
            raise
        merged = deep_merge(merged, base)
        msmap.overlay(bsmap)
    msmap.overlay(smap)
    msmap.file = display
    return deep_merge(merged, data), msmap
