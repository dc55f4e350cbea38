"""Write a job directory all at once: into a temporary sibling, then renamed into place.

A failure or an interruption while writing leaves the target untouched (at worst a hidden
``.<name>.*.tmp`` sibling after a hard kill). An existing target is replaced only with ``force``
and only when it holds nothing but the files an earlier compile wrote (listed in its plan.json),
so `--force` can never delete checkpoints, logs or a directory dsforge did not create.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from dsforge.compiler.emit.job_dir import JobFile
from dsforge.compiler.emit.plan_doc import GENERATOR

DIR_MODE, EXEC_MODE, FILE_MODE = 0o755, 0o755, 0o644


class TargetError(Exception):
    """The output directory cannot be written (exists, not empty, not ours); the message says what to do."""


def _previous_files(target: Path) -> set[str] | None:
    """The files an earlier compile wrote into ``target``, or None if it is not a dsforge job directory."""
    try:
        doc = json.loads((target / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("generator") != GENERATOR or not isinstance(doc.get("files"), list):
        return None
    return {str(name) for name in doc["files"]}


def check_target(target: Path, force: bool) -> None:
    """Raise TargetError unless ``target`` may be (re)written: absent, empty, or (with force) our own output."""
    if target.is_symlink():
        raise TargetError(f"{target} is a symbolic link; give the real directory")
    if not target.exists():
        return
    if not target.is_dir():
        raise TargetError(f"{target} exists and is not a directory")
    entries = sorted(os.listdir(target))
    if not entries:
        return
    if not force:
        raise TargetError(f"{target} is not empty; use --force to replace a job directory dsforge wrote, "
                          "or choose another -o")
    previous = _previous_files(target)
    if previous is None:
        raise TargetError(f"{target} is not a job directory dsforge wrote (no dsforge plan.json); "
                          "refusing to replace it even with --force")
    foreign = [e for e in entries if e not in previous]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise TargetError(f"{target} holds entries dsforge did not write ({shown}); move them out first "
                          "(checkpoints, logs) or compile into another directory")


def _fill(directory: Path, files: Mapping[str, JobFile]) -> None:
    for name, f in files.items():
        path = directory / name
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(f.content)
        os.chmod(path, EXEC_MODE if f.executable else FILE_MODE)
    os.chmod(directory, DIR_MODE)


def _swap_in(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``; an existing target is set aside first and put back if the move fails."""
    if not target.exists() or not os.listdir(target):
        os.replace(tmp, target)  # rename(2) replaces an empty directory atomically
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, aside)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_job_dir(target: Path, files: Mapping[str, JobFile], force: bool = False) -> None:
    """Write ``files`` as the directory ``target``, all or nothing (see the module docstring)."""
    target = Path(os.path.abspath(target))  # "out/" and "." need a real name and parent
    check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _fill(tmp, files)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
