"""DSF610-611: the files and directories a job reads and writes are usable where it is checked.

The loader has already made every relative path absolute against the job file's directory
(dsforge/compiler/frontend/job_paths.py), so these checks see the paths plan.json will record. Without them a
missing token file passes validate and compile and fails only when every rank starts, each with its
own traceback under torchrun's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dsforge.compiler.frontend.job_paths import is_absolute, written_value
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity

DATA_PATH = ("training", "data", "path")
CHECKPOINT_DIR = ("training", "checkpoint", "dir")


def _shown(ctx: Context, key: tuple[str, ...], resolved: str) -> tuple[str, str]:
    """The resolved path, and how the job file wrote it when that differs (`` (written 'data/x', ...)``)."""
    written = written_value(ctx.raw, key)
    if isinstance(written, str) and written != resolved:
        return resolved, f" (written {written!r}, relative to the job file's directory)"
    return resolved, ""


@rule("DSF610", "files the job reads exist", source="dsforge")
def data_file_exists(ctx: Context) -> Iterator[Finding]:
    """`data.kind: tokens` memory-maps `data.path` on every rank at start-up. A path written relative
    to the job file belongs with the job, so its absence is an error wherever the job is checked; an
    absolute path may be a mount that exists only on the machines that run the job, so there it is a
    warning (`dsforge run`, which trains on this machine, refuses either)."""
    data = ctx.spec.training.data
    if data.kind != "tokens" or not isinstance(data.path, str) or not data.path:
        return  # DSF205 reports a missing path (and a list of paths)
    target = Path(data.path).expanduser()
    if target.is_file():
        return
    path, written_as = _shown(ctx, DATA_PATH, data.path)
    fix = ("create the token file or correct training.data.path (a "
           "relative path is taken from the job file's directory)")
    if target.is_dir():
        yield Finding(f"training.data.path {path} is a directory, not a token file{written_as}", fix,
                      DATA_PATH)
        return
    written = written_value(ctx.raw, DATA_PATH)
    relative = isinstance(written, str) and not is_absolute(written)
    if relative:
        yield Finding(f"training.data.path {path} does not exist{written_as}", fix, DATA_PATH)
    else:
        yield Finding(f"training.data.path {path} does not exist on this machine",
                      fix + "; if it exists only on the " "machines that run the job, this warning can be "
                                                          "ignored", DATA_PATH,
                      severity=Severity.WARNING)


@rule("DSF611", "the checkpoint directory can be a directory", source="dsforge")
def checkpoint_dir_usable(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed creates `checkpoint.dir` (and its parents) at the first save, after the first
    interval of training; a file at that path, or at one of its parents, would fail it only then."""
    directory = ctx.spec.training.checkpoint.dir
    target = Path(directory).expanduser()
    if not target.is_absolute():
        return  # the default: inside the job directory, which compile creates
    blocker = next((p for p in (target, *target.parents) if p.exists()), None)
    if blocker is None or blocker.is_dir():
        return
    path, written_as = _shown(ctx, CHECKPOINT_DIR, directory)
    what = "is a file" if blocker == target else f"lies under {blocker}, which is a file"
    yield Finding(
        f"training.checkpoint.dir {path} {what}{written_as}",
        "point training.checkpoint.dir at a directory (or a "
        "path that does not exist yet; it is created at the first save)",
        CHECKPOINT_DIR,
    )
