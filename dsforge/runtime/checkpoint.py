"""Checkpoints of a job: DeepSpeed's own format, saved every N optimizer steps and resumed with `resume:
auto`.

Everything a resumed run needs besides the engine's state is the optimizer-step count: the data
stream is a pure function of the step (dsforge.runtime.data), so step ``s`` reads the same samples
whether or not the run was interrupted before it. Tags are ``step<N>``; the ``latest`` file names
the newest complete one.

A save is a commit, so that a kill at any moment (of any rank, during any write) leaves the previous
complete checkpoint as ``latest``: every rank writes into the temporary tag ``step<N>.partial``
(DeepSpeed's own ``latest`` is not written: it would name the tag before the other ranks finish),
then leaves a marker there; after a barrier rank 0 checks that every rank's marker is present,
renames the directory to ``step<N>`` and replaces ``latest`` atomically (a temporary file renamed
over it). A ``.partial`` directory is an incomplete checkpoint; the next save removes it.

Each tag also holds the layout-free state (dsforge.runtime.train_state) and a copy of the plan.json
and ds_config.json that wrote it: a run whose layout differs loads the former instead of
DeepSpeed's files, once dsforge.compiler.plan.resume_layout has found that only the layout changed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.compiler.spec.schema import CheckpointSpec
from dsforge.runtime.errors import CheckpointError

CLIENT_KEY = "dsforge"
PARTIAL = ".partial"  # suffix of a tag being written
REPLACED = ".replaced"  # suffix of a complete tag being replaced by a new save of the same step
LATEST = "latest"
COMMIT = "dsforge-checkpoint.json"  # written by the commit: step, world size
JOB_FILES = ("plan.json", "ds_config.json")  # the compile that wrote the checkpoint, kept in each tag


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where checkpoints go, how often, and whether to resume from the newest one."""

    directory: Path
    every: int
    resume: bool
    keep: int | str = "all"  # training.checkpoint.keep (dsforge.runtime.retention)
    fall_back: bool = False  # training.checkpoint.if_damaged: fall_back (dsforge.runtime.resume_check)

    @classmethod
    def from_spec(cls, spec: CheckpointSpec, job_dir: str | Path) -> CheckpointPolicy:
        """The policy of `training.checkpoint`; a relative directory (the default, `checkpoints`) lies in the
        job directory (a relative one the job file wrote is already absolute in plan.json)."""
        directory = Path(spec.dir).expanduser()
        if not directory.is_absolute():
            directory = Path(job_dir) / directory
        return cls(directory, spec.every, spec.resume == "auto", spec.keep, spec.if_damaged == "fall_back")

    def due(self, step: int, last: int) -> bool:
        """Save after optimizer step ``step`` (1-based count of steps done)? Every N, and always after the
        last."""
        return step == last or (self.every > 0 and step % self.every == 0)

    def latest_tag(self) -> str | None:
        """The tag the ``latest`` file names, or None when there is no complete checkpoint."""
        latest = self.directory / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
        return tag or None


def tag_of(step: int) -> str:
    """The checkpoint tag of optimizer step ``step``."""
    return f"step{step}"


def save(engine: Any, policy: CheckpointPolicy, step: int, extra: dict[str, Any] | None = None,
         job_dir: Path | None = None) -> Path:
    """Save the engine after ``step`` optimizer steps and commit it (collective: every rank calls it).

    Returns the committed tag's path. See the module docstring for the protocol. ``job_dir``: the
    compiled job directory, whose plan.json and ds_config.json are kept in the tag (a run under
    another layout reads from them how this one cut the model).
    """
    from dsforge.runtime.faults import fault

    rank, world = _rank_and_world()
    directory, tag = policy.directory, tag_of(step)
    partial = directory / f"{tag}{PARTIAL}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_incomplete(directory)  # no rank writes a checkpoint now: all wait at the barrier below
    _barrier()
    state = {CLIENT_KEY: {"step": step, **(extra or {})}}
    from dsforge.runtime.disk_space import guard_save

    with guard_save(partial, directory, step, job_dir):  # a full disk: one line, the partial tag removed
        engine.save_checkpoint(str(directory), tag=partial.name, client_state=state, save_latest=False)
        from dsforge.runtime.weights_io import save_rank_weights

        # Layout-free copies of the weights (dsforge export): collective under ZeRO-3, like the save itself.
        save_rank_weights(engine, partial, rank)
        from dsforge.runtime.train_state import save_state

        save_state(engine, partial, rank, step)  # collective under ZeRO, like the save itself
        if rank == 0 and job_dir is not None:
            for name in JOB_FILES:
                if (Path(job_dir) / name).is_file():
                    shutil.copyfile(Path(job_dir) / name, partial / name)
        fault("save", step)
        (partial / _marker(rank)).write_text(json.dumps({"rank": rank, "step": step}), encoding="utf-8")
        _barrier()
        from dsforge.runtime.checkpoint_manifest import write_share

        write_share(partial, rank, world)  # this rank's share of the digests (every file is written now)
        _barrier()
        if rank == 0:
            commit(directory, tag, step, world, policy.keep)
    _barrier()  # nobody goes on (and may die) before the commit: every rank resumes from the same tag
    return directory / tag


def _marker(rank: int) -> str:
    return f".rank{rank}.done"


def commit(directory: Path, tag: str, step: int, world: int, keep: int | str = "all") -> None:
    """Make ``<tag>.partial`` the checkpoint ``tag`` and point ``latest`` at it, once every rank's marker is
    there.

    The integrity manifest is written before the renames; ``keep`` then deletes older checkpoints
    (dsforge.runtime.retention).
    """
    partial = directory / f"{tag}{PARTIAL}"
    missing = [r for r in range(world) if not (partial / _marker(r)).is_file()]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise CheckpointError(f"the checkpoint of step {step} in {partial} is incomplete: rank(s) {shown} "
                              f"left no marker (every rank must write into the same directory: on several "
                              f"nodes, a shared file system); {LATEST} still names the previous checkpoint")
    (partial / COMMIT).write_text(json.dumps({"step": step, "world_size": world}), encoding="utf-8")
    from dsforge.runtime.checkpoint_manifest import write_manifest

    write_manifest(partial, world)
    final, replaced = directory / tag, directory / f"{tag}{REPLACED}"
    if final.exists():  # a complete save of this step whose commit a kill interrupted, or an older run's
        os.replace(final, replaced)
    os.replace(partial, final)
    _replace_text(directory / LATEST, tag)
    shutil.rmtree(replaced, ignore_errors=True)
    from dsforge.runtime.retention import apply_retention

    apply_retention(directory, step, keep)


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a synced temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)  # the rename itself survives a crash
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_incomplete(directory: Path) -> None:
    """Delete what interrupted saves left: ``*.partial`` tags, and ``*.replaced`` ones whose new tag is
    complete."""
    for p in directory.iterdir():
        if p.is_dir() and p.name.endswith(PARTIAL):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and p.name.endswith(REPLACED):
            done = directory / p.name[: -len(REPLACED)]
            if done.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:  # the kill came between the two renames: the replaced tag is the complete one
                os.replace(p, done)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def resume(engine: Any, policy: CheckpointPolicy, job: dict[str, Any] | None = None,
           ds_config: dict[str, Any] | None = None) -> int:
    """Load the newest checkpoint when the policy resumes and one exists; the number of steps it had done.

    Collective: every rank must see the same checkpoint directory (a shared file system across nodes).
    ``job`` / ``ds_config``: this run's plan.json and ds_config.json documents; when the checkpoint's own
    copies show another layout, its layout-free state is loaded (dsforge.runtime.train_state), after
    dsforge.compiler.plan.resume_layout has found nothing but the layout changed.
    """
    if not policy.resume:
        return 0
    tag = policy.latest_tag()
    if tag is None:
        return 0
    if not (policy.directory / tag).is_dir():
        raise CheckpointError(f"{policy.directory / LATEST} names {tag}, which is not there; move the "
                              f"checkpoint directory away or set "
                              f"training.checkpoint.resume: never to start over")
    from dsforge.runtime.resume_check import intact_tag

    tag = intact_tag(policy, tag)  # the manifest checked before anything is loaded; a fallback is said
    saved = _saved_job(policy.directory / tag)
    if job is not None and saved is not None:
        from dsforge.compiler.plan.resume_layout import resume_refusals, same_layout

        if not same_layout(saved[0], job):
            refusals = resume_refusals(saved[0], job, saved[1], ds_config)
            if refusals:
                raise CheckpointError(f"cannot resume {policy.directory / tag} "
                                      f"under this layout: {refusals[0]}")
            from dsforge.runtime.train_state import TrainStateError, load_state

            try:
                return load_state(engine, policy.directory / tag)
            except TrainStateError as exc:
                raise CheckpointError(f"cannot resume {policy.directory / tag} "
                                      f"under this layout: {exc}") from None
    try:
        path, client = engine.load_checkpoint(str(policy.directory), tag=tag)
    except Exception as exc:  # DeepSpeed raises bare assertions and runtime errors of many kinds
        raise CheckpointError(f"cannot resume from {policy.directory / tag}: {type(exc).__name__}: {exc}. "
                              "A checkpoint saved under another layout (degrees, ZeRO stage) by a dsforge "
                              "that kept no copy of its plan.json in the checkpoint loads only under that "
                              "layout (DSF641); set training.checkpoint.resume: "
                              "never or move the directory away") from exc
    if path is None or not client or CLIENT_KEY not in client:
        raise CheckpointError(f"{policy.directory / tag} is not a dsforge "
                              f"checkpoint (no {CLIENT_KEY!r} client state)")
    return int(client[CLIENT_KEY]["step"])


def _saved_job(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The plan.json (and ds_config.json) of the compile that wrote the checkpoint ``path``; None if
    absent."""
    try:
        plan = json.loads((path / JOB_FILES[0]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        ds = json.loads((path / JOB_FILES[1]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        ds = None
    return (plan, ds) if isinstance(plan, dict) else None
