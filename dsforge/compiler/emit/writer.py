"""Write a job directory all at once: into a temporary sibling, then renamed into place.

A failure or an interruption while writing leaves the target untouched. An existing target is
replaced only with ``force`` and only when it holds nothing but the files an earlier compile wrote
(listed in its plan.json), so `--force` can never delete checkpoints, logs or a directory dsforge
did not create. The replacement is two renames (the old target aside into a hidden
``.<name>.<pid>.*.old`` sibling, the new one into place); SIGINT and SIGTERM are held back while
they run, and any exception between them puts the old target back. A hard kill (SIGKILL, power)
can still leave the old target aside or a ``.<name>.<pid>.*.tmp`` sibling: the next compile of the
same target (``recover``) moves the old target back, or deletes a stale aside once the new target
is complete, and removes the temporary directory, for siblings whose process is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
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
    if not isinstance(doc,
                      dict) or doc.get("generator") != GENERATOR or not isinstance(doc.get("files"), list):
        return None
    return {str(name) for name in doc["files"]}


def refuse_working_directory(target: Path) -> None:
    """Raise TargetError when ``target`` is the working directory or one of its parents (it would be
    replaced)."""
    target = Path(os.path.abspath(target))
    cwd = Path(os.path.abspath(os.getcwd()))
    if cwd == target or target in cwd.parents:
        where = "the working directory" if cwd == target else f"a parent of the working directory ({cwd})"
        raise TargetError(f"{target} is {where}; a job directory is written as a whole and replaces what is "
                          "there, so give a new directory below it, e.g. -o ./job")


def _refuse_place(target: Path) -> None:
    """Raise TargetError when ``target`` is the working directory or above it, or has no parent directory."""
    refuse_working_directory(target)
    parent = target.parent
    if not parent.exists():
        raise TargetError(f"cannot write {target}: its parent directory {parent} does not exist; create it "
                          f"first (mkdir -p {parent}) or choose another -o")
    if not parent.is_dir():
        raise TargetError(f"cannot write {target}: {parent} is a file, not a directory")


def check_target(target: Path, force: bool) -> None:
    """Raise TargetError unless ``target`` may be (re)written: absent, empty, or (with force) our own output.

    Never the working directory or one of its parents, and only below an existing directory.
    """
    target = Path(os.path.abspath(target))
    _refuse_place(target)
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


def _sibling_pattern(name: str) -> re.Pattern[str]:
    """The hidden siblings a write of ``<name>`` makes: ``.<name>.<pid>.<random>.tmp`` or ``.old``."""
    return re.compile(r"\." + re.escape(name) + r"\.(\d+)\.[a-z0-9_]{8}\.(tmp|old)")  # mkdtemp's 8 characters


def _sibling(target: Path, suffix: str) -> Path:
    """A new, empty hidden directory beside ``target`` that names this process (see ``recover``)."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=suffix, dir=target.parent))


def _alive(pid: int) -> bool:
    """True while process ``pid`` exists (a sibling it made may still be in use)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def recover(target: Path) -> list[str]:
    """Repair what a killed write of ``target`` left beside it; one sentence per repair.

    An old target set aside with no target in its place is moved back; an aside whose replacement
    is complete, and a temporary directory, are deleted. Only siblings of processes that are gone
    are touched, so a compile running at the same time keeps its own.
    """
    target = Path(os.path.abspath(target))
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    pattern, done = _sibling_pattern(target.name), []
    stale = []
    for name in names:
        m = pattern.fullmatch(name)
        if m and not _alive(int(m.group(1))):
            path = target.parent / name
            stale.append((m.group(2) != "old", -_mtime(path), path))  # asides first, the newest first
    missing = not target.exists() or (target.is_dir() and not target.is_symlink() and not os.listdir(target))
    for not_aside, _, path in sorted(stale):
        if not not_aside and missing and _previous_files(path) is not None:
            if target.exists():
                target.rmdir()
            os.replace(path, target)
            missing = False
            done.append(f"restored {target} from {path.name}, left by "
                        f"a compile that was killed while replacing it")
        else:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}, left by a compile that was killed")
    return done


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (delivered on exit) by recording them in Python-level handlers.

    Not a thread signal mask: in a process with other threads the kernel gives a process-directed signal to
    any thread that does not block it, and Python then runs the handler in the main thread all the same.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[signal.Signals] = []

    def hold(signum: int, frame: object) -> None:
        pending.append(signal.Signals(signum))

    old = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if pending:
            handler = old[pending[0]]
            if callable(handler):
                handler(pending[0], None)
            elif handler in (signal.SIG_DFL, None):
                signal.raise_signal(pending[0])


def _swap_in(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``; an existing target is set aside first and put back on any exception."""
    if not target.exists() or not os.listdir(target):
        os.replace(tmp, target)  # rename(2) replaces an empty directory atomically
        return
    aside = _sibling(target, ".old")
    try:
        os.replace(target, aside)  # onto the empty directory: atomic
        os.replace(tmp, target)
    except BaseException:
        _put_back(tmp, target, aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _put_back(tmp: Path, target: Path, aside: Path) -> None:
    """Undo whichever of _swap_in's two renames happened: the old target ends where it was."""
    if not os.listdir(aside):  # the first rename did not happen
        aside.rmdir()
        return
    if target.exists() and not tmp.exists():  # both happened: the new target goes back to tmp (deleted later)
        os.replace(target, tmp)
    os.replace(aside, target)


def write_job_dir(target: Path, files: Mapping[str, JobFile], force: bool = False) -> None:
    """Write ``files`` as the directory ``target``, all or nothing (see the module docstring)."""
    target = Path(os.path.abspath(target))  # "out/" and "." need a real name and parent
    recover(target)
    check_target(target, force)
    tmp = _sibling(target, ".tmp")
    try:
        _fill(tmp, files)
        with _signals_held():
            _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
