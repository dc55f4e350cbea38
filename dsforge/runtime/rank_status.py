"""What each rank is doing, in ``<job dir>/status/rank-<r>.json``, so a failed run can say which rank died and
when.

A rank rewrites its file (atomically: a temporary file renamed over it) when it starts, at every
optimizer step, around each checkpoint save, and once more when it ends: ``done``, ``failed``
(with its message) or ``stopped`` (a signal). A rank that is killed (SIGKILL, the out-of-memory
killer, a lost node) has no last word: its file still says what it was doing. `dsforge run`
reads the files after a failed launch (``describe_failure``) and names the ranks that died, the
step, and the ranks that were stopped because of them. Plain JSON, no torch: the runner reads it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIRECTORY = "status"
FINAL = ("done", "failed", "stopped")


def path_of(job_dir: Path, rank: int) -> Path:
    """The status file of ``rank``."""
    return job_dir / DIRECTORY / f"rank-{rank}.json"


@dataclass
class RankStatus:
    """This rank's status file; ``update`` rewrites it (errors writing it never stop training)."""

    job_dir: Path
    rank: int
    step: int = 0
    phase: str = "starting"
    ended: str = ""  # where() when a final phase was first recorded

    def update(self, phase: str | None = None, step: int | None = None, message: str = "") -> None:
        """Record a phase (``starting``, ``training``, ``saving``, or a final one) and the step it is at."""
        if phase in FINAL and self.phase not in FINAL:
            self.ended = self.where()
        self.phase = phase or self.phase
        self.step = self.step if step is None else step
        doc = {"rank": self.rank, "phase": self.phase, "step": self.step, "pid": os.getpid(),
               "host": socket.gethostname(), "time": time.time(), "message": message}
        path = path_of(self.job_dir, self.rank)
        try:
            path.parent.mkdir(exist_ok=True)
            # per thread: the SIGTERM watcher (dsforge.runtime.stop_watch) may write while the main thread
            # does
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(doc), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full job directory: the run goes on, only the failure report is poorer

    def where(self) -> str:
        """Where this rank is, for a message: ``during step 3``, ``while saving the checkpoint of step 2``."""
        if self.ended:
            return self.ended
        if self.phase == "saving":
            return f"while saving the checkpoint of step {self.step}"
        return f"during step {self.step}" if self.step else "before training"


def clear(job_dir: Path) -> None:
    """Remove the status files of an earlier launch (before a new one starts)."""
    directory = job_dir / DIRECTORY
    if directory.is_dir():
        for p in directory.iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)


def read_all(job_dir: Path, world_size: int) -> dict[int, dict[str, Any] | None]:
    """Every rank's last status (None where a rank wrote none or it is unreadable)."""
    out: dict[int, dict[str, Any] | None] = {}
    for rank in range(world_size):
        try:
            doc = json.loads(path_of(job_dir, rank).read_text(encoding="utf-8"))
            out[rank] = doc if isinstance(doc, dict) else None
        except (OSError, ValueError):
            out[rank] = None
    return out


def _where(doc: dict[str, Any]) -> str:
    step = doc.get("step") or 0
    if doc.get("phase") == "saving":
        return f"while saving the checkpoint of step {step}"
    return f"during step {step}" if step else "before training"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_failure(job_dir: Path, world_size: int) -> list[str]:
    """Sentences on which ranks died (no last word), failed (their message) or were stopped, and where."""
    docs = read_all(job_dir, world_size)
    died = sorted((r for r, d in docs.items() if d is not None and d.get("phase") not in FINAL),
                  key=lambda r: (docs[r] or {}).get("time", 0))
    failed = [r for r, d in docs.items() if d is not None and d.get("phase") == "failed"]
    stopped = [r for r, d in docs.items() if d is not None and d.get("phase") == "stopped"]
    silent = [r for r, d in docs.items() if d is None]
    lines = []
    for r in died:
        d = docs[r] or {}
        lines.append(f"rank {r} (pid {d.get('pid')} on {d.get('host')}) died {_where(d)} without a word: "
                     f"killed by a signal (SIGKILL, the out-of-memory killer) or its node was lost")
    for r in failed:
        d = docs[r] or {}
        lines.append(f"rank {r} failed {_where(d)}: {d.get('message') or 'see its message above'}")
    reasons: dict[tuple[str, str], list[int]] = {}
    for r in stopped:
        d = docs[r] or {}
        reasons.setdefault((_where(d), d.get("message") or "when the launcher ended the job"), []).append(r)
    for (where, why), ranks in reasons.items():
        lines.append(f"{_ranks(ranks)} stopped {where} {why}")
    if silent and len(silent) < world_size:
        lines.append(f"{_ranks(silent)} never started (no status file)")
    return lines
