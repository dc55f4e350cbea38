"""A job file as the trainer integrations see it: validated, planned, and checked against a live run.

Torch-free. Each integration loads the job once (``load_job``), refuses layouts its trainer cannot
run (``require_data_parallel``), derives its settings from the plan and, at start-up, compares
what the trainer actually runs with the plan (``check_live``), naming the job-file key to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsforge.compiler.emit.ds_config import build_ds_config
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.plan import ResolvedPlan, build_plan
from dsforge.diagnostics import Diagnostic, Severity


class PluginError(ValueError):
    """The job file cannot drive this trainer; the message says why and what to change."""


class PlanMismatchError(PluginError):
    """The live run differs from the job file's plan (world size, batch, precision, ZeRO stage)."""


@dataclass(frozen=True)
class TrainerJob:
    """A validated job file and its plan, as handed to a trainer integration."""

    file: str
    plan: ResolvedPlan
    source: SourceMap
    raw: dict[str, Any]
    warnings: list[Diagnostic] = field(default_factory=list)

    @property
    def micro_batch(self) -> int:
        """Sequences per rank per forward/backward pass."""
        return self.plan.spec.training.micro_batch

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step (validated: global_batch splits evenly)."""
        return self.plan.grad_accum

    def where(self, *path: str) -> str:
        """`file:line:col` of the key that sets ``path`` (or of the preset that supplies it), for messages."""
        from dsforge.compiler.rules.registry import Context, locate

        ctx = Context(self.plan.spec, build_plan(self.plan.spec), self.source, self.raw)
        return str(locate(ctx, path))

    def ds_config(self) -> dict[str, Any]:
        """A fresh copy of the ds_config `dsforge compile` writes for this job."""
        return build_ds_config(self.plan)


JobLike = str | Path | TrainerJob


def load_job(job: JobLike) -> TrainerJob:
    """Validate a job file and plan it; PluginError with every error when it does not validate."""
    if isinstance(job, TrainerJob):
        return job
    from dsforge.compiler.validate import InvalidJob, require_valid
    from dsforge.formatters import get
    from dsforge.runtime.versions import require_deepspeed

    require_deepspeed(installed_only=True)  # the trainer hands our ds_config to this DeepSpeed

    try:
        result = require_valid(job)
    except InvalidJob as exc:
        text = get("text")(exc.result.diagnostics)
        raise PluginError(f"the job file {job} cannot be used:\n{text}".rstrip()) from None
    warnings = [d for d in result.diagnostics if d.severity == Severity.WARNING]
    return TrainerJob(str(job), result.plan.resolve(), result.job.source, result.job.raw, warnings)


def require_data_parallel(job: TrainerJob, trainer: str) -> None:
    """Refuse tp/pp/cp/ep > 1: these trainers hand the whole model to DeepSpeed without dsforge's groups."""
    d = job.plan.degrees
    split = {k: getattr(d, k) for k in ("tp", "pp", "cp", "ep") if getattr(d, k) > 1}
    if split:
        degrees = ", ".join(f"{k}={v}" for k, v in split.items())
        raise PluginError(
            f"{job.file}: {degrees}: {trainer} passes the model to deepspeed.initialize without dsforge's "
            f"process groups, so DeepSpeed would treat every rank as a data-parallel replica; through this "
            "integration only data parallelism with ZeRO 0-3 runs. Set parallel.tp/pp/cp/ep to 1 (at "
            f"{job.where('parallel')}), or run the job with `dsforge compile` and its launcher "
            f"(dsforge.runtime builds the groups and the parallel model).")


def precision_of(ds_config: Mapping[str, Any]) -> str:
    """bf16, fp16 or fp32, as a ds_config enables it."""
    for name in ("bf16", "fp16"):
        if str(ds_config.get(name, {}).get("enabled", False)).lower() == "true":
            return name
    return "fp32"


#: What check_live compares: name -> (job-file key path, how the plan gives it).
_EXPECTED: dict[str, tuple[tuple[str, ...], Any]] = {
    "world size": (("hardware", "gpus_per_node"), lambda p: p.world_size),
    "micro-batch per rank": (("training", "micro_batch"), lambda p: p.spec.training.micro_batch),
    "gradient accumulation steps": (("training", "global_batch"), lambda p: p.grad_accum),
    "global batch": (("training", "global_batch"), lambda p: p.spec.training.global_batch),
    "precision": (("training", "precision"), lambda p: p.spec.training.precision),
    "ZeRO stage": (("parallel", "zero"), lambda p: p.zero),
}


def mismatches(job: TrainerJob, live: Mapping[str, Any], source: str) -> list[str]:
    """One line per live value that differs from the plan (keys of ``live``: the names of _EXPECTED)."""
    out = []
    for name, value in live.items():
        path, expected = _EXPECTED[name]
        want = expected(job.plan)
        if value is not None and value != want:
            out.append(f"{name}: {source} has {value}, the job file plans {want} ({'.'.join(path)} at "
                       f"{job.where(*path)})")
    return out


def check_live(job: TrainerJob, live: Mapping[str, Any], source: str, fix: str) -> None:
    """Raise PlanMismatchError listing every live value that differs from the plan; ``fix`` says what to
    do."""
    found = mismatches(job, live, source)
    if found:
        raise PlanMismatchError(
            f"the run does not match the job file {job.file}:\n  - "
            + "\n  - ".join(found)
            + f"\n  fix: {fix}"
        )
