"""A checkpoint save that runs out of disk space (ENOSPC, EDQUOT) ends with one line, its partial tag removed.

torch.save reports a short write as ``RuntimeError: ... unexpected pos N vs M`` (PyTorchStreamWriter)
and DeepSpeed passes it on; safetensors as ``SafetensorError: ... No space left on device (os error
28)``; the errno is lost on the way. A failure inside a save counts as a full disk when an errno in
its chain is ENOSPC or EDQUOT, or its message is such a short write or names one of them (nothing
else makes a local write come up short). The line names the checkpoint, the bytes it needed (the size of
the previous complete checkpoint, measured from its manifest, else the cost model's figure from
plan.json) and the free space left; ``latest`` still names the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsforge.runtime.errors import CheckpointError


class DiskFullError(CheckpointError):
    """A checkpoint save ran out of disk space or quota; the message names the checkpoint and the bytes
    (DSF616)."""


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SHORT_WRITE_MARKS = ("unexpected pos", "No space left on device", "Disk quota exceeded", "os error 28)",
                     "os error 122)", "PytorchStreamWriter failed writing")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or one in its cause/context chain) is a write refused for lack of space or quota."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in FULL_ERRNOS:
            return True
        if any(m in str(cur) for m in SHORT_WRITE_MARKS):  # safetensors' SafetensorError is no OSError
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def free_bytes(path: Path) -> int:
    """Bytes a non-root user may still write on the file system of ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def planned_bytes(job_dir: Path | None) -> int | None:
    """The cost model's bytes of one checkpoint (all ranks) from plan.json's summary, or None."""
    if job_dir is None:
        return None
    try:
        doc = json.loads((Path(job_dir) / "plan.json").read_text(encoding="utf-8"))
        return int(doc["summary"]["checkpoint"]["bytes_total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def needed_bytes(directory: Path, job_dir: Path | None) -> tuple[int | None, str]:
    """The bytes one checkpoint needs and where the figure comes from (the previous one measured, or the
    estimate)."""
    from dsforge.runtime.checkpoint_manifest import MANIFEST

    try:
        latest = (directory / "latest").read_text(encoding="utf-8").strip()
        doc: Any = json.loads((directory / latest / MANIFEST).read_text(encoding="utf-8"))
        return int(doc["bytes"]), f"as {latest} measured"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    est = planned_bytes(job_dir)
    return est, "estimated"


def disk_full_message(partial: Path, directory: Path, step: int, job_dir: Path | None) -> str:
    """The one line a save that ran out of space ends with (DSF616)."""
    need, how = needed_bytes(directory, job_dir)
    need_text = f"{need:,} bytes ({how})" if need is not None else "an unknown number of bytes"
    return (f"DSF616: the file system of {directory} is full: the checkpoint of step {step} ({partial.name}, "
            f"removed) needs {need_text}, {free_bytes(directory):,} bytes are free; free space or point "
            "training.checkpoint.dir elsewhere (training.checkpoint.keep limits how many are kept), then run "
            "the same command again: it resumes from the last "
            "complete checkpoint, which `latest` still names")


def remove_partial(partial: Path) -> None:
    """Delete what a failed save wrote (its space is what the next attempt needs)."""
    shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def guard_save(partial: Path, directory: Path, step: int, job_dir: Path | None) -> Iterator[None]:
    """Turn a full disk inside a save into DiskFullError (one line, DSF616), the partial tag removed first."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        remove_partial(partial)
        raise DiskFullError(disk_full_message(partial, directory, step, job_dir)) from None
