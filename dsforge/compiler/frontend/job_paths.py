"""Paths written in a job file are relative to that file's directory, as `extends:` is; resolved once, at
load.

Resolving here, not in each rank, means plan.json records absolute paths: a compiled job directory
runs the same from any working directory, and `dsforge validate` can check that the files exist
(DSF610, dsforge/compiler/rules/paths.py) before anything is launched. A key is resolved against the
directory of the file that wrote it, so a path in an `extends:` base is relative to the base. A job
read from standard input (`<stdin>`) resolves against the working directory. Absolute paths and
`~` paths stay as written (`~` is the home of whoever runs the job, expanded where it runs). Keys a
job file does not write keep their defaults: the default checkpoint directory lies inside the job
directory, which only compile knows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.spec.schema import JobSpec

Key = tuple[str, ...]

#: Every job-file key that names a file or directory on disk. `model.factory` is a module path
#: (`package.module:callable`, imported from sys.path), not a file, so it is not among them.
PATH_KEYS: tuple[Key, ...] = (("training", "data", "path"), ("training", "checkpoint", "dir"),
                              ("model", "pretrained"), ("training", "data", "tokenizer"),
                              ("training", "data", "valid", "path"))


def is_absolute(value: str) -> bool:
    """True for a path that does not depend on the job file's place: absolute, or under `~`."""
    return os.path.isabs(value) or value.startswith("~")


def base_directory(file: str) -> Path:
    """The directory that relative paths written in ``file`` (as a diagnostic names it) are taken from."""
    if not file or file.startswith("<"):  # `<stdin>`: no file, so the working directory
        return Path.cwd()
    return Path(os.path.abspath(file)).parent


def written_value(raw: dict[str, Any], key: Key, missing: Any = None) -> Any:
    """The value the job file (or an `extends:` base) wrote at ``key``, or ``missing`` where it wrote none."""
    node: Any = raw
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def resolve_job_paths(spec: JobSpec, raw: dict[str, Any], source: SourceMap) -> JobSpec:
    """The spec with every relative path the job file wrote made absolute against its file's directory."""
    for key in PATH_KEYS:
        value = written_value(raw, key)
        if key == ("training", "data", "tokenizer") and value == "auto":
            continue  # not a path: model.pretrained's own tokenizer
        # megatron blends
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            base = base_directory(source.locate(key, value=True).file)
            spec = _replaced(spec, key, [v if is_absolute(v) else os.path.normpath(base / v) for v in value])
            continue
        if not isinstance(value, str) or not value or is_absolute(value):
            continue
        base = base_directory(source.locate(key, value=True).file)
        spec = _replaced(spec, key, os.path.normpath(base / value))
    return spec


def _replaced(section: Any, key: Key, value: str | list[str]) -> Any:
    """A copy of ``section`` with the field at ``key`` set to ``value`` (sections are frozen)."""
    head, *rest = key
    new = value if not rest else _replaced(getattr(section, head), tuple(rest), value)
    return section.model_copy(update={head: new})
