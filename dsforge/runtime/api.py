"""``dsforge.initialize(model, job)``: the job's parallel layout applied to a hand-written training loop.

It validates the job (a job file, a compiled job directory, or a parsed JobSpec), joins the process
group the launcher set up, builds the plan's groups, rewrites ``model`` in place into this rank's
parallel variant and returns the DeepSpeed engine around it, built from the job's ds_config with the
plan's groups as ``mpu`` (a ``PipelineModule`` when pp > 1). The model must be the dense model of the
job (same architecture and sizes) with the same weights on every rank, e.g. built from one seed.

Usage (under torchrun, one process per rank)::

    engine = dsforge.initialize(model, "job.yaml")
    for ids in my_batches(dp_rank=engine.dsforge_groups.index("dp")):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

The loop owns the data: ranks of one tensor-parallel group must read the same batch, data-parallel
ranks different ones. With context parallelism each rank feeds its own tokens and their global
``position_ids`` (dsforge.runtime.data does both) and computes its loss share itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from dsforge.compiler.plan.plan import Plan, ResolvedPlan, UnresolvedPlan, build_plan
from dsforge.compiler.spec.schema import JobSpec
from dsforge.runtime.errors import RuntimeRefusal


class JobError(RuntimeRefusal, ValueError):
    """The job given to ``dsforge.initialize`` is invalid; the message lists its errors."""


def load_plan(job: str | os.PathLike[str] | JobSpec | Plan | ResolvedPlan) -> Plan | ResolvedPlan:
    """The plan of a job file, a compiled job directory, a JobSpec or a Plan; JobError if the job has
    errors."""
    if isinstance(job, (Plan, ResolvedPlan)):
        return job
    if isinstance(job, JobSpec):
        return build_plan(job)
    path = Path(job)
    if path.is_dir():
        from dsforge.runtime.main import JobDir

        return JobDir.load(path).plan
    from dsforge.compiler.validate import InvalidJob, require_valid
    from dsforge.formatters import get

    try:
        result = require_valid(path)
    except InvalidJob as exc:
        raise JobError(f"{path} has errors:\n{get('text')(exc.result.diagnostics)}") from None
    return result.plan


def _join(plan: ResolvedPlan) -> None:
    """Join the launcher's process group (gloo on CPU jobs, nccl on GPU) unless one is already up."""
    import torch.distributed as dist

    from dsforge.compiler.deepspeed.ds_settings import on_cpu
    from dsforge.runtime.main import launched_world_size

    if dist.is_initialized():
        return
    from dsforge.runtime.groups import check_world_size

    check_world_size(plan.placement, launched_world_size())
    backend = "gloo" if on_cpu(plan) else "nccl"
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dsforge.runtime.main import JobDir, init_distributed

    init_distributed(JobDir(Path("."), plan, {}, {"dist_backend": backend}))


def initialize(model: nn.Module, job: str | os.PathLike[str] | JobSpec | Plan | ResolvedPlan, *,
               ds_config: dict[str, Any] | None = None) -> Any:
    """Rewrite ``model`` by the job's plan for this rank and return the DeepSpeed engine (see the module doc).

    ``ds_config`` replaces the job's compiled config (the batch keys must still match the plan).
    The engine carries ``dsforge_plan`` and ``dsforge_groups`` for the loop's data sharding.
    """
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.engine import (
        EngineError,
        apply_job_recompute,
        initialize_engine,
        parallelize,
        pipeline_recompute,
    )
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm
    from dsforge.runtime.rewrite import plan_rewrite

    loaded = load_plan(job)
    try:
        plan = loaded if isinstance(loaded, ResolvedPlan) else loaded.resolve()
    except UnresolvedPlan:
        raise JobError("the job has no complete layout (a degree is "
                       "`auto` or the degrees do not fill the world)") \
            from None
    _join(plan)
    ensure_deepspeed_comm()
    groups = create_groups(plan)
    config = ds_config if ds_config is not None else build_ds_config(plan)
    if plan.degrees.pp > 1:
        from dsforge.runtime.pipeline_stages import build_pipeline

        if plan.degrees.cp > 1:
            raise EngineError("cp > 1 with pp > 1 is not supported yet")
        module: nn.Module = build_pipeline(model, plan_rewrite(model, plan), plan, groups,
                                           **pipeline_recompute(plan, groups, config))
        engine = initialize_engine(module, config, None)
    else:
        model = parallelize(model, plan, groups, gather_logits=True)
        apply_job_recompute(model, plan, groups, config)
        engine = initialize_engine(model, config, groups)
    engine.dsforge_plan, engine.dsforge_groups = plan, groups
    return engine
