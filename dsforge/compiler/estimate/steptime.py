"""Step time: compute at an achievable fraction of peak, exposed communication, the pipeline bubble.

The model, per pipeline rank and model chunk:

* a forward (backward) pass lasts its hardware FLOPs / (dense peak x achievable_fraction), plus the
  communication on its critical path: TP, Ulysses and EP collectives are synchronous (Megatron and
  DeepSpeed-MoE run them between the matmuls), ring-CP exchanges hide behind the attention core
  they feed (Liu et al. 2023), ZeRO-3 gathers hide behind the pass they prefetch for (overlap_comm),
  ZeRO-2's per-micro-batch reduce-scatter hides behind the backward only with overlap_comm;
* the passes are placed by the event simulation of the schedule (`schedule.simulate`), pipeline
  transfers delaying each cross-rank dependency, which yields the bubble for uneven stages too; on
  DeepSpeed's PipelineEngine (stacks dsforge and megatron-deepspeed) a send also holds its sender for the
  transfer (`StackProfile.blocking_p2p`): against a rendezvous simulation of DeepSpeed's TrainSchedule
  instructions this tracks the makespan within 0.5-4 % (35 stages x 240 micro-batches to 8 x 8);
* after its last pass each rank reduces gradients and gathers parameters over its data-parallel group
  (exposed: DeepSpeed reduces at the accumulation boundary; with overlap_comm and no pipeline the
  reduction overlaps the last backward) and runs the optimizer, a memory-bound sweep over its
  partition. The step ends when the slowest rank is done;
* stack `dsforge` adds the DeepSpeed engine's own host work (`engine_overhead`: hooks and bucketing per
  micro-batch and parameter tensor, the optimizer tensor by tensor per step), as measured by
  `dsforge calibrate` into ``hardware.engine_overhead``: per micro-batch in the backward pass (ZeRO-3's
  fetches half in the forward), per step after the last pass.

``accelerator.achievable_fraction`` is the share of dense peak the layers' kernels reach on their own
(GEMMs, attention, elementwise work), not end-to-end MFU; the hardware presets calibrate it from
published runs (see their comments) and a job can override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dsforge.compiler.estimate import comm, flops
from dsforge.compiler.estimate.comm import Collective
from dsforge.compiler.estimate.compute import (
    DEFAULT_GEMM_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    Rates,
    chunk_time,
    rates,
)
from dsforge.compiler.estimate.engine_overhead import engine_overhead
from dsforge.compiler.estimate.memo import plan_memo
from dsforge.compiler.estimate.schedule import Timeline, simulate
from dsforge.compiler.estimate.shares import chunk_table, layer_kinds, stage_share
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.model.params import moe_layers_in
from dsforge.compiler.plan.plan import Priced

#: Kept for callers of the old constant: the GEMM efficiency an accelerator that states none is given.
DEFAULT_ACHIEVABLE_FRACTION = DEFAULT_GEMM_EFFICIENCY


class EstimateError(ValueError):
    """The plan cannot be estimated (its layout does not resolve, or the precision has no peak)."""


@dataclass(frozen=True)
class Pass:
    """Duration of one forward or backward pass of one chunk, split into compute and exposed communication."""

    compute_s: float
    comm_s: dict[str, float] = field(default_factory=dict)
    engine_s: float = 0.0  # the DeepSpeed engine's host work in this pass (`engine_overhead`)

    @property
    def seconds(self) -> float:
        """Total duration (s)."""
        return self.compute_s + sum(self.comm_s.values()) + self.engine_s


def achievable_fraction(plan: Priced) -> tuple[float, str]:
    """The fraction of dense peak compute-bound kernels are taken to reach, and where it came from."""
    r = rates(plan, 1.0)
    return r.fraction, r.source


def _exposed_per_link(timed: list[tuple[Collective, float]], compute_s: float,
                      attention_s: float) -> dict[str, float]:
    """Exposed seconds by group of collectives that run in one pass, summed per link before the cover is
    taken.

    Collectives on one link share its bandwidth, so what overlaps compute is hidden only while their sum fits
    the pass's compute (those tagged "attention" only the attention core's); a synchronous one ("none") is
    on the critical path whole. Each link's exposed time is shared among its groups by their busy time.
    """
    exposed: dict[str, float] = {}
    by_link: dict[str, list[tuple[Collective, float]]] = {}
    for op, sec in timed:
        if op.overlap == "none":
            exposed[op.group] = exposed.get(op.group, 0.0) + sec
        else:
            by_link.setdefault(op.link.name, []).append((op, sec))
    for ops in by_link.values():
        busy = sum(sec for _, sec in ops)
        attention = sum(sec for op, sec in ops if op.overlap == "attention")
        late = max(max(0.0, attention - attention_s), busy - compute_s, 0.0)
        for op, sec in ops:
            exposed[op.group] = exposed.get(op.group, 0.0) + (late * sec / busy if busy > 0 else 0.0)
    return exposed


def _pass(ops: tuple[Collective, ...], compute_s: float, attention_s: float, units: dict[str, float],
          engine_s: float) -> Pass:
    """Build one pass: its compute plus the exposed time of its phase's ops (summed per link), each run
    ``units[scope]`` times, and the engine's host work ``engine_s``."""
    timed = []
    for op in ops:
        n = units.get(op.scope, 0.0)
        if n > 0:
            timed.append((op, op.seconds * n))
    return Pass(compute_s, _exposed_per_link(timed, compute_s, attention_s), engine_s)


def _phase_ops(plan: Priced, stage: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """The forward and the backward collectives of one pass of ``stage`` (the pipeline's dependencies left to
    the schedule); once per plan and stage class (what `comm.data_parallel` keys on)."""
    d = plan.degrees
    kinds = layer_kinds(plan, stage)
    key = ("phase_ops", stage == 0, stage == d.pp - 1, kinds[False], kinds[True])
    memo = plan_memo(plan)
    found: tuple[tuple[Collective, ...], tuple[Collective, ...]] | None = memo.get(key)
    if found is None:
        ops = comm.model_parallel(plan) + [
            o for o in comm.data_parallel(plan, stage) if o.scope == "micro-batch"
        ]
        recompute_ops = [
            o for o in ops if o.phase == "forward" and (o.scope != "micro-batch" or refetched(o))
        ]
        if plan.spec.training.recompute == "full":  # the recomputed forward repeats its collectives
            ops = ops + [Collective(o.group, o.op, o.purpose, "backward", o.scope, o.payload_bytes,
                                    o.group_size, o.link, o.overlap, o.repeat) for o in recompute_ops]
        found = memo[key] = tuple(tuple(o for o in ops if o.phase == phase and o.overlap != "dependency")
                                  for phase in ("forward", "backward"))
    return found


def stage_passes(plan: Priced, stage: int, speed: float | Rates) -> tuple[list[Pass], list[Pass]]:
    """Forward and backward passes of each chunk rank ``stage`` holds, at ``speed``: the compute `Rates`
    (`compute.rates`), or a FLOP/s figure that every FLOP runs at."""
    d, model = plan.degrees, plan.model
    r = speed if isinstance(speed, Rates) else Rates(speed, 1.0, 1.0, 0.0, 1.0, 1.0, "FLOP/s given")
    fwd_ops, bwd_ops = _phase_ops(plan, stage)
    chunks = chunk_table(plan)[stage]
    last_chunk = len(plan.stage_layers) - 1
    engine = engine_overhead(plan, stage).micro_batch_s * r.slowdown / len(chunks)
    engine_fwd = engine / 2 if plan.zero == 3 else 0.0  # ZeRO-3 fetches in both passes; 0-2 hook the backward
    fwd, bwd = [], []
    for j, (first_layer, count) in enumerate(chunks):
        k = j * d.pp + stage
        c = chunk_time(plan, first_layer, count, k == 0, k == last_chunk, r)
        # how many times an op of each scope runs in one pass of this chunk
        units = {"layer": count, "moe-layer": moe_layers_in(model, first_layer, count),
                 "first": 1.0 if k == 0 else 0.0, "last": 1.0 if k == last_chunk else 0.0,
                 "micro-batch": 1.0 / len(chunks)}
        fwd.append(_pass(fwd_ops, c.forward_s, c.attention_s, units, engine_fwd))
        bwd.append(_pass(bwd_ops, c.backward_s, 2 * c.attention_s, units, engine - engine_fwd))
        if blocking_send_s(plan) > 0:  # the sender waits out its own transfer (`StackProfile.blocking_p2p`)
            if k < last_chunk:
                fwd[-1] = _with_pp(fwd[-1], blocking_send_s(plan))
            if k > 0:
                bwd[-1] = _with_pp(bwd[-1], blocking_send_s(plan))
    return fwd, bwd


def blocking_send_s(plan: Priced) -> float:
    """Seconds a pipeline send holds its sender where the stack's sends are synchronous (0 elsewhere)."""
    if plan.degrees.pp <= 1 or not profile_of(plan.spec.stack).blocking_p2p:
        return 0.0
    sends = [o for o in comm.pipeline_parallel(plan) if o.overlap == "dependency"]
    return sends[0].seconds if sends else 0.0


def _with_pp(p: Pass, seconds: float) -> Pass:
    """``p`` with ``seconds`` more of pipeline communication on its critical path."""
    return replace(p, comm_s={**p.comm_s, "pp": p.comm_s.get("pp", 0.0) + seconds})


def refetched(op: Collective) -> bool:
    """True for ZeRO-3's forward parameter gather, which a full recompute repeats: the recomputed forward
    fetches the partitioned weights again (stage3 releases them after each module's forward)."""
    return op.group in ("dp-cp", "edp") and op.op == "all-gather" and op.phase == "forward"


#: Host DRAM bandwidth per node a CPU optimizer sweeps at when the hardware states none: 8-12 DDR5 channels
#: per socket reach ~250-400 GB/s of STREAM on the hosts of DGX-class nodes; 200 GB/s for the node, shared by
#: its ranks, is a stated assumption (not measured here).
HOST_MEMORY_BPS = 200e9
#: Host-to-device bandwidth per accelerator when the hardware states no host_link_gbs: PCIe Gen4 x16.
DEFAULT_HOST_LINK_GBS = 25.0


def optimizer_seconds(plan: Priced, stage: int) -> float:
    """The optimizer step of one rank: a memory-bound sweep over its partition of the parameters.

    Adam-family updates read the fp32 master weight, gradient and states and write weight and states
    back, plus the 16-bit copy (DeepSpeed FusedAdam, deepspeed/ops/csrc/adam): 2·(4 + state) + 4 + 2
    bytes per parameter at HBM bandwidth x memory_efficiency. An offloaded optimizer (ZeRO-Offload, Ren
    et al. 2021) copies the 16-bit gradient partition to the host and the updated 16-bit partition back
    over PCIe (``hardware.host_link_gbs``) and runs DeepSpeedCPUAdam over the same bytes in host memory
    (`HOST_MEMORY_BPS` per node, shared by the node's ranks); DeepSpeed overlaps neither with the step.
    """
    d, hw = plan.degrees, plan.spec.hardware
    z = zero_settings(plan)
    share = stage_share(plan, stage, 0.0)
    params = share.dense / (d.dp * d.cp) + share.expert / d.expert_dp if z.stage >= 1 else share.total
    touched = 2 * (4 + z.optimizer_bytes) + 4 + (z.weight_bytes if z.weight_bytes < 4 else 0)
    if z.offload_optimizer:
        link = (hw.host_link_gbs or DEFAULT_HOST_LINK_GBS) * 1e9
        ranks = min(plan.world_size, hw.gpus_per_node)
        return 2 * params * z.weight_bytes / link + params * touched / (HOST_MEMORY_BPS / ranks)
    efficiency = hw.accelerator.memory_efficiency or DEFAULT_MEMORY_EFFICIENCY
    return params * touched / (hw.accelerator.hbm_gbs * 1e9 * efficiency)


def stage_tail(plan: Priced, stage: int, last_backward_s: float, slowdown: float = 1.0) -> dict[str, float]:
    """Exposed seconds after rank ``stage``'s last pass: DP reductions and gathers, tied embeddings,
    optimizer, and the engine's per-step host work (``slowdown``: CPU ranks time-sharing cores,
    `compute.Rates`)."""
    ops = [o for o in comm.data_parallel(plan, stage) if o.scope == "step"]
    if stage in (0, plan.degrees.pp - 1):
        ops += [o for o in comm.pipeline_parallel(plan) if o.scope == "step"]
    tail = _exposed_per_link([(op, op.seconds) for op in ops], last_backward_s, 0.0)
    tail["optimizer"] = optimizer_seconds(plan, stage)
    tail["engine"] = engine_overhead(plan, stage).step_s * slowdown
    return tail


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, timed: the simulated pipeline, the critical rank's time budget, the rates."""

    timeline: Timeline
    forward: list[list[Pass]]
    backward: list[list[Pass]]
    critical_stage: int
    step_s: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # exposed on the critical rank, by group kind
    optimizer_s: float
    model_flops: float
    hardware_flops: float
    tokens: int
    gpus: int
    peak_flops: float
    achievable_fraction: float
    fraction_source: str
    engine_s: float = 0.0  # the DeepSpeed engine's host work on the critical rank (`engine_overhead`)

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second over the whole job."""
        return self.tokens / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU."""
        return self.model_flops / self.step_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation against the dense peak (Chowdhery et al. 2022, PaLM, appendix B)."""
        return flops.utilization(self.model_flops, self.step_s, self.gpus, self.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation (recomputation and capacity padding counted)."""
        return flops.utilization(self.hardware_flops, self.step_s, self.gpus, self.peak_flops)

    def time_to_train(self, tokens: float) -> float:
        """Seconds to train ``tokens`` tokens at this step time."""
        return tokens / self.tokens_per_s


def _check(plan: Priced) -> int:
    """The plan's micro-batches per step; EstimateError unless it resolves to a placeable layout with whole
    ones."""
    if not plan.layout_ok or plan.placement is None or plan.grad_accum is None or not plan.stage_layers:
        raise EstimateError("the layout does not resolve (run `dsforge validate` for the reasons)")
    return plan.grad_accum


def estimate_step(plan: Priced) -> StepTime:
    """Time one optimizer step of a valid plan (see the module docstring for the model)."""
    spec, m = plan.spec, _check(plan)
    peak = flops.dense_peak_flops(spec.hardware.accelerator, spec.training.precision)
    if peak <= 0:
        raise EstimateError(f"{spec.hardware.accelerator.name} has no {spec.training.precision} peak")
    rate = rates(plan, peak)
    frac, source = rate.fraction, rate.source
    passes = [stage_passes(plan, s, rate) for s in range(plan.degrees.pp)]
    fwd, bwd = [p[0] for p in passes], [p[1] for p in passes]
    pp_ops = [o for o in comm.pipeline_parallel(plan) if o.overlap == "dependency"]
    transfer = pp_ops[0].seconds if pp_ops else 0.0
    schedule = spec.parallel.pipeline.schedule
    secs = ([[x.seconds for x in row] for row in fwd], [[x.seconds for x in row] for row in bwd])
    timeline = simulate(schedule, secs[0], secs[1], m, transfer)
    no_transfer = simulate(schedule, secs[0], secs[1], m, 0.0).makespan if transfer else timeline.makespan
    tails = [stage_tail(plan, s, bwd[s][0].compute_s, rate.slowdown) for s in range(plan.degrees.pp)]
    ends = [timeline.end_of(s) + sum(tails[s].values()) for s in range(plan.degrees.pp)]
    r = max(range(len(ends)), key=ends.__getitem__)
    comm_s: dict[str, float] = {}
    for row in (fwd[r], bwd[r]):
        for x in row:
            for kind, sec in x.comm_s.items():
                comm_s[kind] = comm_s.get(kind, 0.0) + sec * m
    for kind, sec in tails[r].items():
        if kind not in ("optimizer", "engine"):
            comm_s[kind] = comm_s.get(kind, 0.0) + sec
    idle = timeline.end_of(r) - timeline.busy(r)
    pp_wait = min(idle, max(0.0, timeline.makespan - no_transfer))
    if pp_wait > 0:
        comm_s["pp"] = comm_s.get("pp", 0.0) + pp_wait
    compute = m * sum(x.compute_s for x in fwd[r] + bwd[r])
    engine = m * sum(x.engine_s for x in fwd[r] + bwd[r]) + tails[r]["engine"]
    return StepTime(timeline, fwd, bwd, r, ends[r], compute, idle - pp_wait, comm_s, tails[r]["optimizer"],
                    flops.model_flops_per_step(plan), flops.hardware_flops_per_step(plan),
                    spec.training.global_batch * plan.model.seq_len, plan.world_size, peak, frac, source,
                    engine)
