"""DSF613: two jobs must not share one checkpoint directory.

`dsforge run` holds a lock in a checkpoint directory outside the job directory
(dsforge.runtime.run_lock), so two jobs training into one at the same time are always refused at
start. Where the directory already holds another job's checkpoints it is visible before that:
every checkpoint keeps a copy of the plan.json that wrote it, and a `latest` whose plan names
another job means this job would resume from, or write over, that job's training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dsforge.compiler.rules.paths import CHECKPOINT_DIR, _shown
from dsforge.compiler.rules.registry import Context, Finding, rule


def _owner(directory: Path) -> str | None:
    """The job name in the plan.json copy of the checkpoint `latest` names in ``directory``, or None."""
    try:
        tag = (directory / "latest").read_text(encoding="utf-8").strip()
        doc = json.loads((directory / tag / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = doc.get("name") if isinstance(doc, dict) else None
    return name if isinstance(name, str) else None


@rule("DSF613", "the checkpoint directory holds no other job's checkpoints", source="dsforge")
def checkpoint_dir_not_shared(ctx: Context) -> Iterator[Finding]:
    """A `training.checkpoint.dir` outside the job directory whose newest checkpoint another job wrote:
    `resume: auto` would load that job's weights into this one (or `never` write over them)."""
    directory = Path(ctx.spec.training.checkpoint.dir).expanduser()
    if not directory.is_absolute():
        return  # the default, inside the job directory
    owner = _owner(directory)
    if owner is None or owner == ctx.spec.name:
        return
    path, written_as = _shown(ctx, CHECKPOINT_DIR, str(directory))
    yield Finding(f"training.checkpoint.dir {path} holds the checkpoints of another job, {owner!r}{written_as}; "
                  "two jobs must not share one checkpoint directory",
                  "give this job its own training.checkpoint.dir (or name the job as the one that wrote them, if it "
                  "is the same training)", CHECKPOINT_DIR)
