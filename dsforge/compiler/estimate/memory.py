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

from dsforge.compiler.deepspeed.ds_settings import emitted_checkpointing_block, on_cpu
from dsforge.compiler.estimate import activations as act
from dsforge.compiler.estimate.lean import lean_note, stack_kernels
from dsforge.compiler.estimate.memo import bounded, plan_memo
from dsforge.compiler.estimate.model_states import ModelStates, megatron_states, model_states
from dsforge.compiler.estimate.shares import RankParams, chunk_table, kind_table, stage_share
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.estimate.stacks.options import stack_options
from dsforge.compiler.estimate.zero_config import ZeroSettings, zero_settings
from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import Priced

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


def activation_shape(plan: Priced) -> act.ActivationShape:
    """The activation-sizing inputs of a plan: micro-batch, sequence, tp/cp/sp, precision, kernels (once per
    plan: every stage asks, and the emitted checkpointing block it reads merges the job's overrides)."""
    memo = plan_memo(plan)
    shape = memo.get("activation_shape")
    if shape is None:
        shape = memo["activation_shape"] = _activation_shape(plan)
    return shape


def _activation_shape(plan: Priced) -> act.ActivationShape:
    t, p = plan.spec.training, plan.spec.parallel
    return act.ActivationShape(
        micro_batch=t.micro_batch, seq_len=plan.model.seq_len, tp=plan.degrees.tp, cp=plan.degrees.cp,
        sequence_parallel=p.sequence_parallel and plan.degrees.tp > 1,
        element_bytes=4 if t.precision == "fp32" else 2, kernels=stack_kernels(plan),
        partition_checkpoints=partitions_checkpoints(plan),
        experts_split=profile_of(plan.spec.stack).experts_split_over_tp)


def partitions_checkpoints(plan: Priced) -> bool:
    """True when the emitted ds_config (overrides merged) partitions checkpointed layer inputs over tp."""
    block = emitted_checkpointing_block(plan)
    return plan.degrees.tp > 1 and bool(block.get("partition_activations", False))


def micro_batches(plan: Priced) -> int:
    """Micro-batches per optimizer step (gradient-accumulation steps), at least 1."""
    if plan.grad_accum:
        return plan.grad_accum
    t = plan.spec.training
    return max(1, t.global_batch // (t.micro_batch * plan.degrees.dp))


@dataclass(frozen=True)
class _PerLayer:
    """Activation bytes of one dense and one MoE layer (kept, and rematerialised), computed once."""

    kept: dict[bool, float]
    working_set: dict[bool, float]

    @classmethod
    def of(cls, plan: Priced, shape: act.ActivationShape) -> _PerLayer:
        return _per_layer(plan.model, shape, plan.spec.training.recompute)


@bounded(maxsize=1024)
def _per_layer(model: ResolvedModel, shape: act.ActivationShape, recompute: str) -> _PerLayer:
    """`_PerLayer.of` from what it reads (the result is shared: its readers never change it)."""
    return _PerLayer({moe: act.layer_bytes(model, shape, moe, recompute) for moe in (False, True)},
                     {moe: act.recompute_working_set(model, shape, moe, recompute) for moe in (False, True)})


@dataclass(frozen=True)
class _Context:
    """What every stage's memory reads of its plan besides the stage, looked up once per plan."""

    chunks: tuple[tuple[tuple[int, int], ...], ...]  # `shares.chunk_table`
    kinds: tuple[tuple[int, int], ...]  # `shares.kind_table`
    shape: act.ActivationShape
    ranks: list[int]  # the first rank of every stage
    cpu: bool
    schedule: str
    output_buffers: bool  # the stack's pipeline engine keeps each in-flight chunk's output
    embedding: float  # act.embedding_bytes
    head: float  # act.head_bytes
    logits: tuple[float, float]  # act.logits_bytes: (saved, transient)


def _context(plan: Priced) -> _Context:
    memo = plan_memo(plan)
    ctx: _Context | None = memo.get("memory_context")
    if ctx is None:
        if plan.placement is None:  # estimate_memory refuses such plans first; the search's bound gives 0
            raise ValueError("the memory estimate needs a rank placement "
                             "(degrees filling the world, an order)")
        model, shape = plan.model, activation_shape(plan)
        ctx = memo["memory_context"] = _Context(
            chunk_table(plan), kind_table(plan), shape, plan.placement.first_group("pp"), on_cpu(plan),
            plan.spec.parallel.pipeline.schedule, profile_of(plan.spec.stack).pipeline_output_buffers,
            act.embedding_bytes(model, shape), act.head_bytes(model, shape),
            act.logits_bytes(model, shape, padded_vocab(model, plan.degrees.tp)))
    return ctx


@dataclass(frozen=True)
class _Template:
    """What stages alike in position (first, last) and layers by kind share: their parameters, model states,
    activation bytes of one micro-batch through their layers and the largest rematerialised layer."""

    share: RankParams
    st: _States
    per_mb: float
    working_set: float


def _template(plan: Priced, stage: int, z: ZeroSettings, m: int, per: _PerLayer, ctx: _Context) -> _Template:
    d = plan.degrees
    dense, moe = ctx.kinds[stage]
    layers = {False: dense, True: moe}  # `layer_kinds`
    share = stage_share(plan, stage, z.persistence_threshold, layers)
    st = _stage_states(plan.spec.stack, share, z, d.dp * d.cp, max(1, d.expert_dp), m, ctx.cpu,
                       *stack_options(plan.spec, z.weight_bytes))
    kinds = {moe: count for moe, count in layers.items() if count}
    per_mb = sum(count * per.kept[moe] for moe, count in kinds.items())
    return _Template(share, st, per_mb, max((per.working_set[moe] for moe in kinds), default=0.0))


def _activations(plan: Priced, stage: int, ctx: _Context, m: int, tpl: _Template) -> tuple[float, float]:
    """(activations, logits) bytes one rank of ``stage`` holds at its peak under the schedule."""
    model, d, shape = plan.model, plan.degrees, ctx.shape
    chunks = len(ctx.chunks[stage])
    flight = act.in_flight(ctx.schedule, d.pp, stage, m, chunks)
    chunk_flight = -(-flight // chunks)  # micro-batches of the first/last chunk in flight
    total = flight * tpl.per_mb / chunks
    total += tpl.working_set
    if d.pp > 1 and stage < d.pp - 1 and ctx.output_buffers:
        # the pipeline engine keeps each in-flight chunk's output until its backward (DeepSpeed
        # PipelineEngine pipe_buffers["outputs"]); no layer saves it, so it comes on top
        total += flight * shape.tokens * model.hidden * shape.element_bytes / shape.sp_div
    if stage == 0:
        total += chunk_flight * ctx.embedding
    logits = 0.0
    if stage == d.pp - 1:
        total += chunk_flight * ctx.head
        saved, transient = ctx.logits
        logits = chunk_flight * saved + transient
    return total, logits


def _reserve(cpu: bool, tensor_bytes: float) -> float:
    if cpu:
        return CPU_RESERVE_BYTES
    return GPU_RESERVE_BYTES + FRAGMENTATION * tensor_bytes


@dataclass(frozen=True)
class _States:
    """A stage's model states and its two moments without activations (update, step), reserve included."""

    states: ModelStates
    update: dict[str, float]
    step: dict[str, float]
    update_total: float


@bounded(maxsize=4096)
def _stage_states(stack: str, share: RankParams, z: ZeroSettings, n_dense: int, n_expert: int, m: int,
                  cpu: bool, fp32_grads: bool = False, fp8_recipe: str | None = None) -> _States:
    """The model states of a stage's share under the stack's optimizer layout, with the moments that hold no
    activations (the same for every stage of that share); shared, so its readers copy what they keep."""
    prof = profile_of(stack)
    if prof.optimizer == "deepspeed":  # DeepSpeed's engine: dsforge's runtime and Megatron-DeepSpeed
        states = model_states(share, z, n_dense, n_expert, m)
    else:
        states = megatron_states(share, z, n_dense, n_expert, fp32_grads, prof.distributed_optimizer,
                                 fp8_recipe)
    update = _with_reserve(cpu, {**_ZEROS, **states.update})
    return _States(states, update, _with_reserve(cpu, {**_ZEROS, **states.step}), sum(update.values()))


def stage_memory(plan: Priced, stage: int, z: ZeroSettings, m: int,
                 per: _PerLayer | None = None) -> StageMemory:
    """Device and host bytes of one rank of pipeline ``stage`` (ValueError without a rank placement)."""
    ctx = _context(plan)
    return _stage_memory(plan, stage, m, ctx,
                         _template(plan, stage, z, m, per or _PerLayer.of(plan, ctx.shape), ctx))


def _stage_memory(plan: Priced, stage: int, m: int, ctx: _Context, tpl: _Template) -> StageMemory:
    st = tpl.st
    activ, logits = _activations(plan, stage, ctx, m, tpl)
    backward = _with_reserve(ctx.cpu,
                             {**_ZEROS, **st.states.backward, "activations": activ, "logits": logits})
    moments = {"backward": backward, "update": dict(st.update), "step": dict(st.step)}
    # the larger; a tie: backward
    phase = "update" if st.update_total > sum(backward.values()) else "backward"
    return StageMemory(stage, ctx.ranks[stage], dict(moments[phase]), dict(st.states.host), phase, moments)


def _with_reserve(cpu: bool, comps: dict[str, float]) -> dict[str, float]:
    """The components with the framework reserve added (every moment lists DEVICE_COMPONENTS in order)."""
    return {**comps, "reserve": _reserve(cpu, sum(comps.values()))}


def estimate_memory(plan: Priced) -> MemoryEstimate:
    """Estimate every pipeline stage's memory for a plan whose layout is valid (else ValueError)."""
    # a PricedPlan (DSF301's fixes, the bounds' plans) may still lack these; a ResolvedPlan never does
    if not plan.layout_ok or plan.placement is None or not plan.stage_layers:
        raise ValueError("estimate_memory needs a valid layout (degrees "
                         "filling the world, a stage partition)")
    memo = plan_memo(plan)  # the plan is immutable: rules and the search ask again
    cached: MemoryEstimate | None = memo.get("memory_estimate")
    if cached is not None:
        return cached
    z = zero_settings(plan)
    m = micro_batches(plan)
    ctx = _context(plan)
    per = _PerLayer.of(plan, ctx.shape)
    ranks = ctx.ranks
    alike: dict[tuple[object, ...], StageMemory] = {}
    templates: dict[tuple[object, ...], _Template] = {}
    stages = []
    pp = plan.degrees.pp
    for s in range(pp):
        key = _stage_class(plan, s, m)
        if key not in alike:
            tkey = (s == 0, s == pp - 1, ctx.kinds[s])
            tpl = templates.get(tkey)
            if tpl is None:
                tpl = templates[tkey] = _template(plan, s, z, m, per, ctx)
            alike[key] = _stage_memory(plan, s, m, ctx, tpl)
            stages.append(alike[key])
        else:
            same = alike[key]
            stages.append(replace(same, stage=s, rank=ranks[s], components=dict(same.components),
                                  host=dict(same.host),
                                  moments={k: dict(v) for k, v in same.moments.items()}))
    stack = plan.spec.stack
    notes = (f"reserve: {'CPU 0.45 GB' if on_cpu(plan) else 'GPU 2 GB + 5 % fragmentation'}",
             lean_note(plan) if stack == "dsforge" else
             f"stack {stack}: TE flash attention, fused norms/SwiGLU/GELU, fused vocab-parallel "
             f"cross-entropy, no pipeline output buffers, experts "
             f"split over TP, distributed optimizer (zero: 1)"
             if stack == "megatron-te" else
             f"stack {stack}: Megatron's fused softmax/bias-GELU, unfused attention scores, DeepSpeed's "
             "PipelineEngine output buffers and ZeRO as configured")
    out = MemoryEstimate(stages, plan.spec.hardware.accelerator.memory_gb * 1e9, m, notes)
    memo["memory_estimate"] = out
    return out


def _stage_class(plan: Priced, stage: int, m: int) -> tuple[object, ...]:
    """Everything of a stage `stage_memory` reads besides its index: first or last (embedding, head, logits,
    output buffers), its layers by kind and per chunk, and the micro-batches it holds in flight. Stages alike
    in these have the same bytes (a deep pipeline's middle stages), so `estimate_memory` computes them
    once."""
    d, ctx = plan.degrees, _context(plan)
    chunks = ctx.chunks[stage]
    flight = act.in_flight(ctx.schedule, d.pp, stage, m, len(chunks))
    return stage == 0, stage == d.pp - 1, ctx.kinds[stage], tuple(count for _, count in chunks), flight
