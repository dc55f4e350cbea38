"""What `dsforge run` checks on this machine before any rank starts (no torch here).

* The job directory is locked before anything is written to it (dsforge.runtime.run_lock), and the
  checkpoint directory too when it lies outside the job directory.
* Free space: the checkpoint file system must hold what the retention needs at its peak
  (plan.json's ``summary.checkpoint``, from the cost model; the previous checkpoint's measured size
  when there is one): with ``training.checkpoint.keep: N`` a shortfall is refused (DSF614), with
  ``keep: all`` it is a warning, since the run may be stopped or the checkpoints moved before the
  disk fills.
* A stale ``torch_extensions`` build lock (DSF617): torch's JIT build of a DeepSpeed op (the CPU
  ``deepspeed_shm_comm``, ``cpu_adam``, ...) creates ``<build dir>/lock`` and removes it when done;
  a build killed meanwhile leaves it, and every later build of that op waits for it forever.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: A lock file older than this is no build in progress (a CPU op builds in a minute or two).
STALE_BUILD_LOCK_S = 15 * 60
#: ... nor one this old that no process works beside (torch writes the ninja file, then ninja runs there).
IDLE_BUILD_LOCK_S = 60


class PreflightError(RuntimeError):
    """The job cannot start on this machine now; the message says why and what to do."""


def lock_for_run(job_dir: Path) -> None:
    """Lock the job directory for `dsforge run` (held until the command exits); RunError (exit 2) when it is
    busy."""
    from dsforge.commands.run_error import RunError
    from dsforge.runtime.run_lock import BusyError, lock_job_dir

    try:
        lock_job_dir(job_dir, "dsforge run")
    except BusyError as exc:
        raise RunError(str(exc)) from None


def lock_for_compile(out: str | os.PathLike[str]) -> None:
    """Lock an existing job directory for `dsforge compile` (held until the command exits); TargetError if
    busy."""
    from dsforge.compiler.emit.writer import TargetError
    from dsforge.runtime.run_lock import BusyError, lock_job_dir

    target = Path(os.path.abspath(out))
    if not target.exists():
        return  # nothing runs in a directory that does not exist; compile writes it whole
    try:
        lock_job_dir(target, "dsforge compile")
    except BusyError as exc:
        raise TargetError(str(exc)) from None


def _plan(job_dir: Path) -> dict[str, Any]:
    doc = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
    return doc if isinstance(doc, dict) else {}


def checkpoint_dir(job_dir: Path, doc: dict[str, Any]) -> Path:
    """The job's checkpoint directory as the ranks will resolve it."""
    directory = Path(str(doc["job"]["training"]["checkpoint"].get("dir", "checkpoints"))).expanduser()
    return directory if directory.is_absolute() else job_dir / directory


def before_launch(job_dir: Path) -> list[str]:
    """Every check before the launcher starts: notes and warnings to print; RunError (exit 2) to refuse."""
    from dsforge.commands.run_error import RunError
    from dsforge.runtime.run_lock import BusyError, held, lock_checkpoint_dir

    doc = _plan(job_dir)
    directory = checkpoint_dir(job_dir, doc)
    try:
        lock_checkpoint_dir(directory, job_dir, "dsforge run")
        notes = [f"note: {lock.took_over}" for lock in held() if lock.took_over]
        notes += space_check(directory, doc)
        notes += build_lock_check()
    except (BusyError, PreflightError) as exc:
        raise RunError(str(exc)) from None
    return notes


def _existing(directory: Path) -> tuple[int, int | None]:
    """Committed checkpoints in ``directory`` and the measured bytes of the newest one (None without a
    manifest)."""
    from dsforge.runtime.disk_space import needed_bytes
    from dsforge.runtime.retention import complete_steps

    steps = complete_steps(directory)
    if not steps:
        return 0, None
    measured, how = needed_bytes(directory, None)
    return len(steps), measured if how.startswith("as ") else None


def space_check(directory: Path, doc: dict[str, Any]) -> list[str]:
    """Free space against the retention's peak: PreflightError (DSF614) with a keep, a warning without."""
    from dsforge.runtime.disk_space import free_bytes

    ck = (doc.get("summary") or {}).get("checkpoint")
    if not isinstance(ck, dict):
        return []  # a plan.json without the estimate (the cost model failed: DSF690 said so)
    existing, measured = _existing(directory)
    each = measured or int(ck["bytes_total"])
    keep, saves = ck["keep"], int(ck["saves"])
    if isinstance(keep, int):
        more = max(1, min(keep + 1, saves + existing) - existing)
    else:
        more = max(1, saves - existing)
    need, free = each * more, free_bytes(directory)
    if free >= need:
        return []
    source = "measured on the newest checkpoint" if measured else "estimated, explain's `checkpoint on disk`"
    text = (f"DSF614: the file system of {directory} has {free:,} bytes free; the checkpoints this run still "
            f"writes need {need:,} at their peak ({more} x {each:,} "
            f"bytes, {source}; training.checkpoint.keep: {keep})")
    if isinstance(keep, int):
        raise PreflightError(f"{text}; free space, lower training.checkpoint.keep, or point "
                             f"training.checkpoint.dir at a larger file system")
    return [(f"warning: {text}; set training.checkpoint.keep to "
             f"bound them, or the disk fills before the run ends")]


def extensions_root() -> Path:
    """Where torch's JIT builds DeepSpeed's ops: TORCH_EXTENSIONS_DIR, else the user cache's
    torch_extensions."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "torch_extensions"


def _building(build_dir: Path) -> bool | None:
    """Whether a process works in ``build_dir`` (ninja and the compiler run there); None when /proc cannot
    tell."""
    target = str(build_dir.resolve())
    seen_any = False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for pid in entries:
        if not pid.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue  # gone, or another user's
        seen_any = True
        if cwd == target or cwd.startswith(target + os.sep):
            return True
    return False if seen_any else None


def build_lock_check(root: Path | None = None, now: float | None = None) -> list[str]:
    """PreflightError (DSF617) for a stale build lock; a note for one a build in progress holds.

    Stale: no process works in its build directory and it is older than IDLE_BUILD_LOCK_S, or (where
    /proc does not tell) it is older than STALE_BUILD_LOCK_S.
    """
    root = root or extensions_root()
    now = time.time() if now is None else now
    locks = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    stale: list[tuple[Path, float]] = []
    young: list[tuple[Path, float]] = []
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue
        building = _building(lock.parent)
        dead = (building is False and age > IDLE_BUILD_LOCK_S) or age > STALE_BUILD_LOCK_S
        (stale if dead else young).append((lock, age))
    if stale:
        shown = " ".join(str(p) for p, _ in stale)
        raise PreflightError(f"DSF617: {shown}: a build lock of torch's JIT compiler, left {stale[0][1]:.0f} "
                             f"s ago by a run killed while it built a DeepSpeed op (no process works in its "
                             f"build directory); every start would wait for it forever. If no build is "
                             f"running on this machine, remove it: rm {shown}")
    return [f"note: {p} is a build lock of torch's JIT compiler ({age:.0f} s old): another start is building "
            f"a DeepSpeed op, and this one waits until it finishes" for p, age in young]
