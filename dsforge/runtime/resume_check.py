"""Before a resume loads anything: the checkpoint's manifest is checked, and a damaged one refused or skipped.

Every rank checks its share of the files (dsforge.runtime.checkpoint_manifest.share) and the
problems are gathered on every rank, so all ranks refuse, or all fall back to the same checkpoint.
With ``training.checkpoint.if_damaged: fall_back`` the newest committed checkpoint below the damaged
one that passes is taken; rank 0 says which was skipped and why, and the run report
(memory_report.json's ``resume``) records it. A checkpoint without a manifest (saved by a dsforge
before manifests) is loaded as before, with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: What this process's resume decided (rank 0 writes it into the run report).
RESUME_RECORD: dict[str, Any] = {}


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank (a collective when the world has more than one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return problems
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, problems)
    return [p for part in out for p in (part or [])]


def problems_of(tag_dir: Path) -> list[str] | None:
    """What is wrong with ``tag_dir`` by its manifest (collective), or None when it has no manifest."""
    from dsforge.runtime.checkpoint_manifest import DamagedCheckpoint, check_share, read_manifest

    rank, world = _rank_world()
    try:
        local: list[str] | None = [] if read_manifest(tag_dir) is not None else None
        if local is not None:
            local = check_share(tag_dir, rank, world)
    except DamagedCheckpoint as exc:
        local = exc.problems
    gathered = _gather(["\0none"] if local is None else local)
    if gathered and all(p == "\0none" for p in gathered):
        return None
    return [p for p in gathered if p != "\0none"]


def intact_tag(policy: Any, tag: str) -> str:
    """``tag`` if its files match its manifest; else the newest intact one below it (fall_back), or
    DamagedCheckpoint."""
    from dsforge.runtime.checkpoint_manifest import DamagedCheckpoint
    from dsforge.runtime.retention import TAG, complete_steps

    RESUME_RECORD.clear()
    directory = Path(policy.directory)
    problems = problems_of(directory / tag)
    if problems is None:
        _say(f"dsforge: note: {directory / tag} has no integrity "
             f"manifest (saved by an older dsforge): not checked")
        RESUME_RECORD.update(tag=tag, checked=False)
        return tag
    if not problems:
        RESUME_RECORD.update(tag=tag, checked=True)
        return tag
    damaged = DamagedCheckpoint(directory / tag, problems)
    if not policy.fall_back:
        raise damaged.with_fix("restore it, or set training.checkpoint.if_damaged: fall_back to resume from "
                               "the newest intact checkpoint, or start over with `dsforge run --fresh`")
    skipped = [{"tag": tag, "problems": problems}]
    m = TAG.fullmatch(tag)
    below = [s for s in complete_steps(directory) if m is None or s < int(m.group(1))]
    for step in reversed(below):
        candidate = f"step{step}"
        found = problems_of(directory / candidate)
        if found:
            skipped.append({"tag": candidate, "problems": found})
            continue
        _say(f"dsforge: {damaged}; resuming from the newest intact checkpoint, {directory / candidate} "
             f"(training.checkpoint.if_damaged: fall_back)")
        RESUME_RECORD.update(tag=candidate, checked=found is not None, skipped=skipped)
        return candidate
    raise damaged.with_fix(
        "no older checkpoint there is intact either; restore one, or start over with `dsforge run --fresh`")


def _say(text: str) -> None:
    if _rank_world()[0] == 0:
        print(text, flush=True)
