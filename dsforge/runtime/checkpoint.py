"""Checkpoints of a job: DeepSpeed's own format, saved every N optimizer steps and resumed with `resume: auto`.

Everything a resumed run needs besides the engine's state is the optimizer-step count: the data
stream is a pure function of the step (dsforge.runtime.data), so step ``s`` reads the same samples
whether or not the run was interrupted before it. Tags are ``step<N>``; DeepSpeed's ``latest`` file
names the newest one, and it is written only after every rank has finished writing its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.compiler.schema import CheckpointSpec

CLIENT_KEY = "dsforge"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this job; the message says which and why."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where checkpoints go, how often, and whether to resume from the newest one."""

    directory: Path
    every: int
    resume: bool

    @classmethod
    def from_spec(cls, spec: CheckpointSpec, job_dir: str | Path) -> CheckpointPolicy:
        """The policy of `training.checkpoint`; a relative directory (the default, `checkpoints`) lies in the job
        directory (a relative one the job file wrote is already absolute in plan.json)."""
        directory = Path(spec.dir).expanduser()
        if not directory.is_absolute():
            directory = Path(job_dir) / directory
        return cls(directory, spec.every, spec.resume == "auto")

    def due(self, step: int, last: int) -> bool:
        """Save after optimizer step ``step`` (1-based count of steps done)? Every N, and always after the last."""
        return step == last or (self.every > 0 and step % self.every == 0)

    def latest_tag(self) -> str | None:
        """The tag DeepSpeed's ``latest`` file names, or None when there is no complete checkpoint."""
        latest = self.directory / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
        return tag or None


def tag_of(step: int) -> str:
    """The checkpoint tag of optimizer step ``step``."""
    return f"step{step}"


def save(engine: Any, policy: CheckpointPolicy, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Save the engine after ``step`` optimizer steps (collective: every rank calls it); returns the tag's path."""
    policy.directory.mkdir(parents=True, exist_ok=True)
    state = {CLIENT_KEY: {"step": step, **(extra or {})}}
    engine.save_checkpoint(str(policy.directory), tag=tag_of(step), client_state=state)
    return policy.directory / tag_of(step)


def resume(engine: Any, policy: CheckpointPolicy) -> int:
    """Load the newest checkpoint when the policy resumes and one exists; the number of steps it had done.

    Collective: every rank must see the same checkpoint directory (a shared file system across nodes).
    """
    if not policy.resume:
        return 0
    tag = policy.latest_tag()
    if tag is None:
        return 0
    try:
        path, client = engine.load_checkpoint(str(policy.directory), tag=tag)
    except Exception as exc:  # DeepSpeed raises bare assertions and runtime errors of many kinds
        raise CheckpointError(f"cannot resume from {policy.directory / tag}: {type(exc).__name__}: {exc}. "
                              "A checkpoint saved under another layout (degrees, ZeRO stage) does not load; "
                              "set training.checkpoint.resume: never or move the directory away") from exc
    if path is None or not client or CLIENT_KEY not in client:
        raise CheckpointError(f"{policy.directory / tag} is not a dsforge checkpoint (no {CLIENT_KEY!r} client state)")
    return int(client[CLIENT_KEY]["step"])
