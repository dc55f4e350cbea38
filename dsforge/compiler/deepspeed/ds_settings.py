"""The DeepSpeed settings dsforge chooses for a plan, shared by the emitter and the estimates.

`emit/ds_config.py` writes these blocks into ds_config.json; `estimate/` sizes the buffers of the same
blocks (with the job's `deepspeed:` overrides merged over them, as in the emitted file), so the estimate
describes the config that really runs. Living below both keeps either stage from importing the other.
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.deepspeed.ds_schema import merge_zero
from dsforge.compiler.frontend.extends import deep_merge
from dsforge.compiler.plan.plan import AnyPlan


def on_cpu(plan: AnyPlan) -> bool:
    """True when the ranks are CPU processes (the `cpu-local` hardware): gloo, no streams, no fused kernels.

    The accelerator name is exactly ``cpu``, the test that picks the gloo backend and DS_ACCELERATOR=cpu at
    run time, so a GPU whose name merely contains "cpu" is estimated as the GPU it runs as.
    """
    return plan.spec.hardware.accelerator.name.lower() == "cpu"


def overrides(plan: AnyPlan, section: str) -> dict[str, Any]:
    """The job's `deepspeed.<section>` override block, {} when absent or not a mapping."""
    ds = plan.spec.deepspeed if isinstance(plan.spec.deepspeed, dict) else {}
    block = ds.get(section, {})
    return block if isinstance(block, dict) else {}


def zero_section(plan: AnyPlan) -> dict[str, Any]:
    """``zero_optimization`` with the knobs that matter for the stage, buckets scaled to the model width.

    Bucket sizes follow HF transformers' DeepSpeed integration (integrations/deepspeed.py,
    ``trainer_config_finalize``): reduce bucket hidden^2 elements, ZeRO-3 prefetch 0.9 x hidden^2,
    persistence threshold 10 x hidden (parameters smaller than that stay unpartitioned: norms, biases).
    overlap_comm needs a second stream to overlap anything; the CPU accelerator has none.
    """
    stage, h = plan.zero, plan.spec.model.hidden
    z: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return z
    z.update(overlap_comm=not on_cpu(plan), reduce_bucket_size=h * h, reduce_scatter=True)
    if stage in (1, 2):
        z.update(allgather_partitions=True, allgather_bucket_size=h * h)
    if stage >= 2:
        z["contiguous_gradients"] = True
    if stage == 3:
        z.update(stage3_prefetch_bucket_size=int(0.9 * h * h), stage3_param_persistence_threshold=10 * h,
                 stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9,
                 stage3_gather_16bit_weights_on_model_save=True)
    offload = plan.spec.training.optimizer.offload
    if offload != "none":
        # Pinned host memory makes the optimizer-state copies asynchronous (runtime/zero/offload_config.py);
        # an NVMe path is site-specific and comes from the `deepspeed:` overrides (checked by DSF601).
        z["offload_optimizer"] = {"device": offload, "pin_memory": True}
    return z


def emitted_zero_block(plan: AnyPlan) -> dict[str, Any]:
    """The `zero_optimization` block ds_config.json carries: `zero_section` with the job's overrides merged
    (an override replaces every spelling of its setting: `prefetch_bucket_size` the `stage3_` one dsforge
    writes)."""
    return merge_zero(zero_section(plan), overrides(plan, "zero_optimization"))


def checkpointing_section(plan: AnyPlan) -> dict[str, Any]:
    """``activation_checkpointing`` for recompute selective|full (runtime/activation_checkpointing/config.py).

    With full recompute and tp > 1 each tensor-parallel rank keeps only its slice of a checkpointed
    input (partition_activations; Megatron's distribute-saved-activations): the inputs are identical
    across the TP group. Selective recompute checkpoints only the attention core, whose inputs TP
    already shards.
    """
    d, recompute = plan.degrees, plan.spec.training.recompute
    if recompute == "none":
        return {}
    partition = recompute == "full" and d is not None and d.tp > 1
    return {"activation_checkpointing": {"partition_activations": partition, "cpu_checkpointing": False,
                                         "contiguous_memory_optimization": False,
                                         "synchronize_checkpoint_boundary": False, "profile": False}}


def emitted_checkpointing_block(plan: AnyPlan) -> dict[str, Any]:
    """The `activation_checkpointing` block ds_config.json carries (overrides merged); {} when it has none."""
    ds = plan.spec.deepspeed if isinstance(plan.spec.deepspeed, dict) else {}
    merged = deep_merge(checkpointing_section(plan),
                        {k: v for k, v in ds.items() if k == "activation_checkpointing"})
    block = merged.get("activation_checkpointing", {})
    return block if isinstance(block, dict) else {}


def pipeline_partitioning(sequence_parallel: bool, tp: int) -> dict[str, bool]:
    """``pipe_partitioned`` / ``grad_partitioned`` for a pipeline's stages (dsforge.runtime uses this too).

    DeepSpeed's PipelineEngine assumes the activations and gradients sent between stages are the same on
    every TP rank, so by default each rank sends 1/tp of them and the receiver all-gathers
    (runtime/pipe/engine.py ``_exec_forward_pass``, ``_exec_backward_pass``: PartitionedTensor over the
    slice-parallel group). Under sequence parallelism with tp > 1 each TP rank holds its own sequence
    slice instead: partitioning would glue together slices of different ranks and the loss comes out
    wrong, so both are off.
    """
    replicated = not (sequence_parallel and tp > 1)
    return {"pipe_partitioned": replicated, "grad_partitioned": replicated}


def precision_section(plan: AnyPlan) -> dict[str, Any]:
    """``bf16`` or ``fp16`` (dynamic loss scaling, DeepSpeed's defaults spelled out); nothing for fp32."""
    prec = plan.spec.training.precision
    if prec == "bf16":
        return {"bf16": {"enabled": True}}
    if prec == "fp16":
        # loss_scale 0 = dynamic (runtime/precision_config.py); start at 2^16, halve on overflow after
        # `hysteresis` overflows, grow again after loss_scale_window clean steps.
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    return {}


#: DeepSpeed's optimizer type per job-file name. "SGD" is not a DeepSpeed optimizer: the engine falls
#: back to ``getattr(torch.optim, type)`` for names outside DEEPSPEED_OPTIMIZERS.
DS_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam", "lion": "Lion", "lamb": "Lamb", "sgd": "SGD"}


def scheduler_type(name: str, warmup_steps: int) -> str | None:
    """The DeepSpeed scheduler dsforge emits for a job's schedule (None: a constant rate without warm-up)."""
    if name == "constant":
        return "WarmupLR" if warmup_steps else None
    return "WarmupCosineLR" if name == "cosine" else "WarmupDecayLR"
