"""DSF613: two job files validated together must not name one checkpoint directory.

`dsforge validate a.yaml b.yaml` sees both jobs: when two different job files resolve
`training.checkpoint.dir` to the same directory, each would resume from, or write over, the other's
checkpoints, and both are reported, each naming the other. (The default, `checkpoints`, lies in each
job's own directory.) A second job started on a directory in use is refused at start by the
checkpoint directory's lock (dsforge.runtime.run_lock, DSF612), whether or not anyone validated
them together. A different job resuming another's finished checkpoints under a new layout, on
purpose, is not two jobs sharing one: it is not refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsforge.diagnostics import Diagnostic, Severity

KEY = ("training", "checkpoint", "dir")


def shared_checkpoint_dirs(results: Sequence[Any]) -> list[Diagnostic]:
    """A DSF613 error for each job file of ``results`` (validate's) whose checkpoint directory another one
    names."""
    by_dir: dict[str, list[Any]] = {}
    for r in results:
        if r.job is None:
            continue
        written = Path(r.job.spec.training.checkpoint.dir).expanduser()
        if not written.is_absolute():
            continue  # inside the job's own directory
        by_dir.setdefault(os.path.normpath(written), []).append(r)
    out = []
    for directory, group in by_dir.items():
        files = {os.path.abspath(r.file) for r in group}
        if len(files) < 2:
            continue
        for r in group:
            others = sorted({o.file for o in group if os.path.abspath(o.file) != os.path.abspath(r.file)})
            out.append(Diagnostic("DSF613", Severity.ERROR,
                                  f"training.checkpoint.dir {directory} is also the checkpoint directory of "
                                  f"{', '.join(others)}; two jobs must not share one (each would resume "
                                  f"from, or write over, the other's checkpoints)",
                                  r.job.source.locate(KEY, value=True),
                                  "give each job its own training.checkpoint.dir", KEY))
    return out
