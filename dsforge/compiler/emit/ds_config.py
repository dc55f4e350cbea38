"""ds_config.json from a plan: batch split, ZeRO, precision, optimizer, schedule, pipeline, recompute.

Every value follows from the plan (the ZeRO and activation-checkpointing blocks come from
`dsforge/compiler/deepspeed/ds_settings.py`, which the estimates read too); the job file's `deepspeed:`
section is merged last, each override replacing every spelling of its setting (`ds_schema.merge_overrides`;
rules DSF508 and DSF520-DSF521 have already refused overrides that contradict the plan). DeepSpeed's batch
identity ``train_batch_size == micro * gas * world_size`` (deepspeed/runtime/config.py
``DeepSpeedConfig._batch_assertion``) is checked against the world size DeepSpeed *sees*: the runtime passes
an mpu built from the plan (a PipelineModule brings its own topology), whose
``get_data_parallel_world_size()`` is the plan's dp, so the identity is global = micro x gas x dp. Without
that mpu, AutoTP would count tensor-parallel ranks as data-parallel ones (research doc R2).
"""

from __future__ import annotations

from typing import Any

# on_cpu stays importable from here: launchers, plan_doc, the runtime and the plugins read it from this
# module.
from dsforge.compiler.deepspeed.ds_schema import merge_overrides
from dsforge.compiler.deepspeed.ds_settings import (
    checkpointing_section,
    on_cpu,
    pipeline_partitioning,
    precision_section,
    zero_section,
)
from dsforge.compiler.emit.optim import optimizer_section, scheduler_section
from dsforge.compiler.plan.plan import ResolvedPlan


class EmitError(ValueError):
    """The plan cannot be emitted (a value the rules should have refused); the message says why."""


def batch_section(plan: ResolvedPlan) -> dict[str, Any]:
    """The three batch keys; they satisfy DeepSpeed's identity with world size = the plan's dp."""
    t = plan.spec.training
    return {"train_batch_size": t.global_batch, "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": plan.grad_accum}


def pipeline_section(plan: ResolvedPlan) -> dict[str, Any]:
    """``pipeline`` for pp > 1. DeepSpeed reads activation_checkpoint_interval and the two partitioning
    switches (runtime/pipe/engine.py); stages and partition are read by dsforge.runtime, which builds
    the PipelineModule."""
    d = plan.degrees
    if d.pp == 1:
        return {}
    part = plan.spec.parallel.pipeline.partition
    return {"pipeline": {"stages": d.pp, "partition": part if isinstance(part, str) else list(part),
                         "activation_checkpoint_interval": 1 if plan.spec.training.recompute == "full" else 0,
                         **pipeline_partitioning(plan.spec.parallel.sequence_parallel, d.tp)}}


def parallel_sections(plan: ResolvedPlan) -> dict[str, Any]:
    """Sections for the runtime's parallel choices that DeepSpeed itself reads.

    dsforge.runtime shards tensor-parallel layers itself and passes the mpu, so DeepSpeed's AutoTP
    stays off (``tensor_parallel.autotp_size`` 0, its default); experts use DeepSpeed's MoE layer with
    ``ep_size`` from the plan, which needs no config block (AutoEP's ``expert_parallel`` would replace
    the layers again). With context parallelism the engine switches *all* gradient communication to
    ``seq_parallel_communication_data_type`` (runtime/engine.py ``_configure_distributed_model``), so it is
    pinned to fp32 to keep reductions exact.
    """
    if plan.degrees.cp > 1:
        return {"seq_parallel_communication_data_type": "fp32"}
    return {}


def steps_per_print(steps: int) -> int:
    """About ten progress lines per run, at least every step and at most every 100 steps."""
    return max(1, min(100, steps // 10))


def build_ds_config(plan: ResolvedPlan) -> dict[str, Any]:
    """The complete ds_config for a plan, with the job's `deepspeed:` overrides merged last."""
    t = plan.spec.training
    torch_adam = on_cpu(plan) and t.optimizer.offload == "none"
    cfg: dict[str, Any] = {
        **batch_section(plan),
        "zero_optimization": zero_section(plan),
        **precision_section(plan),
        "optimizer": optimizer_section(t.optimizer, torch_adam),
        "gradient_clipping": t.grad_clip,
        **pipeline_section(plan),
        **checkpointing_section(plan),
        **parallel_sections(plan),
        "steps_per_print": steps_per_print(t.steps),
        "wall_clock_breakdown": False,
    }
    sched = scheduler_section(t.scheduler, t.optimizer.lr, t.steps)
    if sched is not None:
        cfg["scheduler"] = sched
    from dsforge.compiler.emit.monitor import monitor_sections

    cfg.update(monitor_sections(plan.spec))
    return merge_overrides(cfg, plan.spec.deepspeed)
