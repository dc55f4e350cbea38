"""Memory per rank and pipeline stage: model states, activations, logits and a framework reserve.

Every rank of a pipeline stage holds the same shapes (tp, dp, cp and ep ranks are symmetric up to
ZeRO's padding), so one rank per stage is estimated; the stage with the largest device total
decides whether the job fits. Model states: `model_states.py`; activations: `activations.py`, with
the kernel profile of the job's `stack:` (`stacks/`): for dsforge's own runtime `HF_SDPA`, because
that is what `dsforge.runtime` runs (HF modules, SDPA attention, which uses a flash kernel on GPUs and,
in torch 2.x, on the CPU too: measured, so no score matrices are counted on either); for megatron-te
`MEGATRON_TE` with Megatron-Core's optimizer layout (`model_states.megatron_states`).

Framework reserve, stated: on a GPU 2 GB for the CUDA context, cuBLAS workspaces and NCCL
communicator buffers (about 0.5-1 GB for the context on Hopper, the rest for NCCL), plus 5 % of the
tensor bytes for the caching allocator's fragmentation; on the CPU accelerator 0.45 GB: the peak
resident size of one rank of a dsforge run whose tensors are negligible (examples/tiny-3d.yaml, 8 ranks:
434-436 MiB each, of which under 2 MiB are tensors), i.e. what torch, DeepSpeed, transformers, the gloo
groups and the engine cost before the model does; importing torch and deepspeed alone is 247 MB
(shared/research/deepspeed.md (g)).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from dsforge.compiler.ds_settings import emitted_checkpointing_block, on_cpu
from dsforge.compiler.estimate import activations as act
from dsforge.compiler.estimate.memo import bounded, plan_memo
from dsforge.compiler.estimate.model_states import ModelStates, megatron_states, model_states
from dsforge.compiler.estimate.shares import RankParams, chunk_table, kind_table, layer_kinds, stage_share
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.estimate.zero_config import ZeroSettings, zero_settings
from dsforge.compiler.params import padded_vocab
from dsforge.compiler.plan import Plan
from dsforge.compiler.resolved import ResolvedModel

GPU_RESERVE_BYTES = 2.0e9
CPU_RESERVE_BYTES = 0.45e9
FRAGMENTATION = 0.05

#: Stable component names, in display order.
DEVICE_COMPONENTS = ("parameters", "gradients", "optimizer", "buffers", "activations", "logits", "reserve")
_ZEROS = dict.fromkeys(DEVICE_COMPONENTS[:-1], 0.0)  # every moment lists every component, in this order


@dataclass(frozen=True)
class StageMemory:
    """Estimated bytes of the worst rank of one pipeline stage, on the device and on the host.

    The components describe the rank at its peak moment: during backward (activations live) or, when
    larger, in the update after it (gradient reduction and optimizer step; activations freed).
    """

    stage: int
    rank: int
    components: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)
    phase: str = "backward"  # the moment the components describe: "backward" or "update"
    #: every moment's components: "backward", "update" (gradient reduction and step; the larger of the
    #: reduction and the step) and "step" (inside the optimizer step alone, what a step hook measures)
    moments: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def device_bytes(self) -> float:
        """Total device bytes of this rank."""
        return sum(self.components.values())

    @property
    def host_bytes(self) -> float:
        """Total host (CPU) bytes of this rank (offloaded optimizer state and the like)."""
        return sum(self.host.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage memory of a plan against the accelerator's capacity."""

    stages: list[StageMemory]
    capacity_bytes: float
    micro_batches: int = 1
    assumptions: tuple[str, ...] = ()

    @cached_property
    def peak(self) -> StageMemory:
        """The stage with the largest device total (the one that decides the fit)."""
        return max(self.stages, key=lambda s: s.device_bytes)

    @property
    def utilization(self) -> float:
        """Peak device bytes as a fraction of the accelerator's memory."""
        return self.peak.device_bytes / self.capacity_bytes


def activation_shape(plan: Plan) -> act.ActivationShape:
    """The activation-sizing inputs of a plan: micro-batch, sequence, tp/cp/sp, precision, kernels (once per plan:
    every stage asks, and the emitted checkpointing block it reads merges the job's overrides)."""
    memo = plan_memo(plan)
    shape = memo.get("activation_shape")
    if shape is None:
        shape = memo["activation_shape"] = _activation_shape(plan)
    return shape


def _activation_shape(plan: Plan) -> act.ActivationShape:
    assert plan.degrees is not None
    t, p = plan.spec.training, plan.spec.parallel
    return act.ActivationShape(
        micro_batch=t.micro_batch, seq_len=plan.model.seq_len, tp=plan.degrees.tp, cp=plan.degrees.cp,
        sequence_parallel=p.sequence_parallel and plan.degrees.tp > 1,
        element_bytes=4 if t.precision == "fp32" else 2, kernels=profile_of(plan.spec.stack).kernels,
        partition_checkpoints=partitions_checkpoints(plan),
        experts_split=profile_of(plan.spec.stack).experts_split_over_tp)


def partitions_checkpoints(plan: Plan) -> bool:
    """True when the emitted ds_config (overrides merged) partitions checkpointed layer inputs over tp."""
    block = emitted_checkpointing_block(plan)
    return plan.degrees is not None and plan.degrees.tp > 1 and bool(block.get("partition_activations", False))


def micro_batches(plan: Plan) -> int:
    """Micro-batches per optimizer step (gradient-accumulation steps), at least 1."""
    if plan.grad_accum:
        return plan.grad_accum
    assert plan.degrees is not None
    t = plan.spec.training
    return max(1, t.global_batch // (t.micro_batch * plan.degrees.dp))


@dataclass(frozen=True)
class _PerLayer:
    """Activation bytes of one dense and one MoE layer (kept, and rematerialised), computed once."""

    kept: dict[bool, float]
    working_set: dict[bool, float]

    @classmethod
    def of(cls, plan: Plan, shape: act.ActivationShape) -> _PerLayer:
        return _per_layer(plan.model, shape, plan.spec.training.recompute)


@bounded(maxsize=1024)
def _per_layer(model: ResolvedModel, shape: act.ActivationShape, recompute: str) -> _PerLayer:
    """`_PerLayer.of` from what it reads (the result is shared: its readers never change it)."""
    return _PerLayer({moe: act.layer_bytes(model, shape, moe, recompute) for moe in (False, True)},
                     {moe: act.recompute_working_set(model, shape, moe, recompute) for moe in (False, True)})


def _activations(plan: Plan, stage: int, shape: act.ActivationShape, m: int, per: _PerLayer,
                 layers: dict[bool, int]) -> tuple[float, float]:
    """(activations, logits) bytes one rank of ``stage`` holds at its peak under the schedule."""
    assert plan.degrees is not None
    model, d = plan.model, plan.degrees
    chunks = len(chunk_table(plan)[stage])
    kinds = {moe: count for moe, count in layers.items() if count}
    per_mb = sum(count * per.kept[moe] for moe, count in kinds.items())
    flight = act.in_flight(plan.spec.parallel.pipeline.schedule, d.pp, stage, m, chunks)
    chunk_flight = -(-flight // chunks)  # micro-batches of the first/last chunk in flight
    total = flight * per_mb / chunks
    total += max((per.working_set[moe] for moe in kinds), default=0.0)
    if d.pp > 1 and stage < d.pp - 1 and profile_of(plan.spec.stack).pipeline_output_buffers:
        # the pipeline engine keeps each in-flight chunk's output until its backward (DeepSpeed
        # PipelineEngine pipe_buffers["outputs"]); no layer saves it, so it comes on top
        total += flight * shape.tokens * model.hidden * shape.element_bytes / shape.sp_div
    if stage == 0:
        total += chunk_flight * act.embedding_bytes(model, shape)
    logits = 0.0
    if stage == d.pp - 1:
        total += chunk_flight * act.head_bytes(model, shape)
        saved, transient = act.logits_bytes(model, shape, padded_vocab(model, d.tp))
        logits = chunk_flight * saved + transient
    return total, logits


def _reserve(plan: Plan, tensor_bytes: float, cpu: bool | None = None) -> float:
    if on_cpu(plan) if cpu is None else cpu:
        return CPU_RESERVE_BYTES
    return GPU_RESERVE_BYTES + FRAGMENTATION * tensor_bytes


@bounded(maxsize=4096)
def _model_states(stack: str, share: RankParams, z: ZeroSettings, n_dense: int, n_expert: int, m: int) -> ModelStates:
    """The model states of a stage's share under the stack's optimizer layout (shared: read, never changed)."""
    prof = profile_of(stack)
    if prof.name == "dsforge":
        return model_states(share, z, n_dense, n_expert, m)
    return megatron_states(share, z, n_dense, n_expert, prof.fp32_main_grads, prof.distributed_optimizer)


def _pp_ranks(plan: Plan) -> list[int]:
    """The first rank of every pipeline stage (the group of rank 0), once per plan."""
    memo = plan_memo(plan)
    ranks = memo.get("pp_ranks")
    if ranks is None:
        assert plan.placement is not None
        ranks = memo["pp_ranks"] = plan.placement.first_group("pp")
    return ranks


def stage_memory(plan: Plan, stage: int, z: ZeroSettings, m: int, per: _PerLayer | None = None) -> StageMemory:
    """Device and host bytes of one rank of pipeline ``stage``."""
    assert plan.degrees is not None and plan.placement is not None
    d = plan.degrees
    kinds = layer_kinds(plan, stage)
    share = stage_share(plan, stage, z.persistence_threshold, kinds)
    states = _model_states(plan.spec.stack, share, z, d.dp * d.cp, max(1, d.expert_dp), m)
    shape = activation_shape(plan)
    activ, logits = _activations(plan, stage, shape, m, per or _PerLayer.of(plan, shape), kinds)
    cpu = on_cpu(plan)
    moments = {name: _with_reserve(plan, {**_ZEROS, **values}, cpu)
               for name, values in (("backward", {**states.backward, "activations": activ, "logits": logits}),
                                    ("update", states.update), ("step", states.step))}
    phase = max(("backward", "update"), key=lambda name: sum(moments[name].values()))
    rank = _pp_ranks(plan)[stage]
    return StageMemory(stage, rank, dict(moments[phase]), dict(states.host), phase, moments)


def _with_reserve(plan: Plan, comps: dict[str, float], cpu: bool | None = None) -> dict[str, float]:
    return {**comps, "reserve": _reserve(plan, sum(comps.values()), cpu)}


def estimate_memory(plan: Plan) -> MemoryEstimate:
    """Estimate every pipeline stage's memory for a plan whose layout is valid (else ValueError)."""
    if not plan.layout_ok or plan.degrees is None or plan.placement is None or not plan.stage_layers:
        raise ValueError("estimate_memory needs a valid layout (degrees filling the world, a stage partition)")
    memo = plan_memo(plan)  # the plan is immutable: rules and the search ask again
    cached: MemoryEstimate | None = memo.get("memory_estimate")
    if cached is not None:
        return cached
    z = zero_settings(plan)
    m = micro_batches(plan)
    per = _PerLayer.of(plan, activation_shape(plan))
    ranks = _pp_ranks(plan)
    alike: dict[tuple[object, ...], StageMemory] = {}
    stages = []
    for s in range(plan.degrees.pp):
        key = _stage_class(plan, s, m)
        if key not in alike:
            alike[key] = stage_memory(plan, s, z, m, per)
            stages.append(alike[key])
        else:
            same = alike[key]
            stages.append(replace(same, stage=s, rank=ranks[s], components=dict(same.components),
                                  host=dict(same.host), moments={k: dict(v) for k, v in same.moments.items()}))
    stack = plan.spec.stack
    notes = (f"reserve: {'CPU 0.45 GB' if on_cpu(plan) else 'GPU 2 GB + 5 % fragmentation'}",
             "activations: dsforge's HF models (SDPA flash attention, no dropout, HF norms and activations)"
             if stack == "dsforge" else
             f"stack {stack}: TE flash attention, fused norms/SwiGLU/GELU, fused vocab-parallel cross-entropy, "
             "no pipeline output buffers, experts split over TP, distributed optimizer (zero: 1)")
    out = MemoryEstimate(stages, plan.spec.hardware.accelerator.memory_gb * 1e9, m, notes)
    memo["memory_estimate"] = out
    return out


def _stage_class(plan: Plan, stage: int, m: int) -> tuple[object, ...]:
    """Everything of a stage `stage_memory` reads besides its index: first or last (embedding, head, logits,
    output buffers), its layers by kind and per chunk, and the micro-batches it holds in flight. Stages alike
    in these have the same bytes (a deep pipeline's middle stages), so `estimate_memory` computes them once."""
    assert plan.degrees is not None
    d = plan.degrees
    chunks = chunk_table(plan)[stage]
    flight = act.in_flight(plan.spec.parallel.pipeline.schedule, d.pp, stage, m, len(chunks))
    return stage == 0, stage == d.pp - 1, kind_table(plan)[stage], tuple(count for _, count in chunks), flight
