"""`training.checkpoint.keep: N`: delete older complete checkpoints once a newer one has committed.

Called by rank 0 right after a commit moved ``latest`` (dsforge.runtime.checkpoint.commit). It keeps
the checkpoint ``latest`` names and the N - 1 newest complete ones below it, and deletes the other
complete ones below it, oldest first. Tags of higher steps than ``latest`` (left by an earlier run
over the same directory with ``resume: never``, or by a resume that fell back past a damaged one)
are never touched: nothing the new run wrote makes them obsolete. ``keep: all`` (the default) keeps
every checkpoint, as before.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

TAG = re.compile(r"step(\d+)")
COMMIT = "dsforge-checkpoint.json"  # dsforge.runtime.checkpoint.COMMIT: only committed tags are counted


def complete_steps(directory: Path) -> list[int]:
    """The steps of the committed checkpoints in ``directory``, ascending."""
    out = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    for p in entries:
        m = TAG.fullmatch(p.name)
        if m and p.is_dir() and (p / COMMIT).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def obsolete(steps: list[int], latest: int, keep: int) -> list[int]:
    """Which of ``steps`` retention deletes when ``latest`` is the newest commit: all below it but the keep -
    1 newest."""
    below = sorted(s for s in steps if s < latest)
    survivors = max(0, keep - 1)
    return below[: max(0, len(below) - survivors)]


def apply_retention(directory: Path, latest_step: int, keep: int | str) -> list[int]:
    """Delete the checkpoints ``keep`` no longer covers (none for ``all``); the deleted steps."""
    if not isinstance(keep, int):
        return []
    gone = obsolete(complete_steps(directory), latest_step, keep)
    for step in gone:
        # The commit file goes first: a tag whose deletion is cut short no longer counts as complete.
        (directory / f"step{step}" / COMMIT).unlink(missing_ok=True)
        shutil.rmtree(directory / f"step{step}", ignore_errors=True)
    return gone
