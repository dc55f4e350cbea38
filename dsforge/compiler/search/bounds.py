"""Lower bounds that let the search skip candidates without estimating them, each provably below the estimate.

* Memory: a rank holds at least its model states, whatever its activations: its 16-bit (or fp32) weights,
  whole under ZeRO 0-2 and partitioned under ZeRO-3, and its partition of the fp32 master weights and
  optimizer moments unless they are offloaded (Rajbhandari et al. 2020, sec. 3.1: 2 + 12 bytes per parameter).
* Step time, cheap: no pass runs faster than the dense peak times the GEMM efficiency the cost model prices
  GEMMs and the attention core at (`compute_speed`), so a rank's busy time is at least its hardware FLOPs over
  that rate; over a p-stage pipeline of m micro-batches stage k cannot start before micro-batch 1 crossed
  stages 0..k-1, so the step lasts at least max_k (sum_{s<k} c_s + m c_k), which over all splits of the work
  is at least C / (1 - (1 - 1/m)^p), C the work of one micro-batch over all stages: the analytic bubble for
  uneven stages (for equal stages it is (m + p - 1) c, Narayanan et al. 2021).
* Step time, tight: the same chain with the estimate's own pass durations (compute and exposed communication)
  and point-to-point transfers: max_k (sum_{s<k} (F_s + B_s) of chunk 0 + 2k transfers + m x the passes of
  stage k), which the simulated schedule can only exceed (dependencies add waiting, never remove work), plus
  rank 0's step tail (exposed reductions, optimizer, engine), which the step adds after rank 0's last pass.

The engine checks every bound against the estimate it later computes and, should one ever exceed it, repeats
the search without pruning (so a change of the cost model can make the search slower, never wrong).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from typing import Any

from dsforge.compiler.estimate import flops
from dsforge.compiler.estimate.shares import stage_share
from dsforge.compiler.estimate.zero_config import OPTIMIZER_STATE_BYTES
from dsforge.compiler.model.params import is_moe_layer
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import Priced


def model_state_bytes(plan: Priced, average: bool = False) -> float:
    """A lower bound of the busiest rank's device bytes: its model states alone (0 when the plan does not
    split); ``average``: the mean over the stages, which bounds the busiest stage of every split into chunks
    (the layers and the embedding and head are the same whatever the split), so one bound serves every
    virtual_stages."""
    d = plan.degrees
    if not plan.stage_layers:
        return 0.0
    t = plan.spec.training
    b = 4 if t.precision == "fp32" else 2
    master = 0 if t.precision == "fp32" else 4  # fp32 training updates its weights in place
    k = OPTIMIZER_STATE_BYTES.get(t.optimizer.name, 4)
    zero = plan.zero
    offload = t.optimizer.offload != "none"
    total, most = 0.0, 0.0
    for stage, alike in stage_classes(plan.model, tuple(plan.stage_layers), d.pp):
        share = stage_share(plan, stage, 0.0)
        part = share.total if zero == 0 else share.dense / (d.dp * d.cp) + share.expert / max(1, d.expert_dp)
        weights = b * (part if zero == 3 else share.total)
        states = 0.0 if offload else (master + k) * part
        total, most = total + alike * (weights + states), max(most, weights + states)
    return total / d.pp if average else most


@lru_cache(maxsize=512)
def stage_classes(model: ResolvedModel, layers: tuple[int, ...], pp: int) -> tuple[tuple[int, int], ...]:
    """The pipeline stages in classes of alike ones, as (first stage of the class, stages in it): a stage's
    parameters follow from whether it is the first or the last (embedding, head) and from the layers of each
    of its chunks (how many, how many MoE), chunk j of stage s being j x pp + s of ``layers`` (the layers per
    chunk, `Plan.stage_layers`); a pipeline of 1,024 stages has three classes, not 1,024."""
    starts = [0, *accumulate(layers)]
    moe = [0, *accumulate(int(is_moe_layer(model, i)) for i in range(starts[-1]))]
    found: dict[tuple[Any, ...], list[int]] = {}
    for s in range(pp):
        chunks = tuple((layers[c],
                        moe[starts[c] + layers[c]] - moe[starts[c]]) for c in range(s, len(layers), pp))
        entry = found.setdefault((s == 0, s == pp - 1, chunks), [s, 0])
        entry[1] += 1
    return tuple((first, count) for first, count in found.values())


def compute_speed(plan: Priced) -> float:
    """The fastest FLOP/s the cost model lets one rank compute at: the dense peak times the share of it that
    its compute-bound kernels reach, over the ranks that time-share a core (`compute.rates`).
    `compute.chunk_time` prices every FLOP that `flops.chunk_flops` counts at no more than this (each GEMM and
    the attention core at the GEMM rate or slower, a roofline only adds), except shared experts, which it does
    not price: those models get the dense peak."""
    peak = flops.dense_peak_flops(plan.spec.hardware.accelerator, plan.spec.training.precision)
    moe = plan.model.moe
    if peak <= 0 or (moe is not None and moe.shared_experts):
        return peak
    from dsforge.compiler.estimate.compute import rates

    r = rates(plan, peak)
    return peak * r.fraction / r.slowdown if r.fraction > 0 else peak


def compute_floor_s(plan: Priced, hardware_flops: float | None = None, speed: float | None = None) -> float:
    """A lower bound of the step time from FLOPs at ``speed`` (default `compute_speed`: no FLOP runs faster in
    the cost model) and the analytic bubble of the pipeline (``hardware_flops``: the step's, when the caller
    has it)."""
    d, m = plan.degrees, plan.grad_accum
    if m is None or m < 1:  # a PricedPlan whose batch does not split
        return 0.0
    peak = speed if speed is not None else compute_speed(plan)
    if peak <= 0:
        return 0.0
    total = hardware_flops if hardware_flops is not None else flops.hardware_flops_per_step(plan)
    return chain_floor_s(total / (plan.world_size * peak), d.pp, m, plan.virtual_stages)


def chain_floor_s(busy: float, pp: int, m: int, virtual_stages: int) -> float:
    """The step-time floor of `compute_floor_s` from a rank's mean busy time: the analytic bubble over a
    ``pp``-stage pipeline of ``m`` micro-batches (none for the interleaved schedule, which it does not
    bound)."""
    if pp == 1 or virtual_stages > 1 or m < 1:
        return busy
    per_micro_batch = busy * pp / m  # C: one micro-batch over every stage
    return max(busy, per_micro_batch / (1.0 - (1.0 - 1.0 / m) ** pp))


def micro_batch_dp_s(plan: Priced) -> float:
    """A lower bound of one micro-batch's passes (forward plus backward, over its chunks) on pipeline rank 0
    from the data-parallel collectives it runs every micro-batch alone (ZeRO-2's gradient reduce-scatter,
    ZeRO-3's parameter gathers; none under ZeRO 0-1): a pass lasts at least the busy time of each link it
    uses, whatever of that overlaps its compute (`steptime._exposed_per_link`: compute plus the part of a
    link's busy time that compute does not cover), and other collectives on the link only add to it. Rank 0
    runs every pass of the step in turn, so the step lasts at least m times this. The same for every
    micro-batch size and recompute policy of a degree combination (the collectives carry parameters and
    gradients, not activations)."""
    from dsforge.compiler.estimate import comm

    ops = [o for o in comm.data_parallel(plan, 0) if o.scope == "micro-batch" and o.overlap != "dependency"]
    total = 0.0
    for phase in ("forward", "backward"):
        busy: dict[str, float] = {}
        for o in ops:
            if o.phase == phase:
                busy[o.link.name] = busy.get(o.link.name, 0.0) + o.seconds
        total += max(busy.values(), default=0.0)
    return total


def edge_memory_bytes(plan: Priced, stop_above: float = float("inf"),
                      cache: dict[Any, Any] | None = None) -> float:
    """A lower bound of the busiest rank's device bytes: the larger of the first and the last pipeline stage's
    estimate (the peak is the largest stage; these two hold the embedding, the logits and, in 1F1B, the most
    micro-batches in flight, so the bound is nearly always the peak itself) at the cost of two stages, not pp;
    the last is skipped when the first already exceeds ``stop_above``. ``cache``: the search's memo of the
    inputs many candidates share (the ZeRO settings of a stage and pipeline depth, the per-layer activation
    bytes of an activation shape and recompute policy), keyed by everything they are computed from."""
    d = plan.degrees
    try:
        from dsforge.compiler.estimate.memory import _PerLayer, activation_shape, micro_batches, stage_memory
        from dsforge.compiler.estimate.zero_config import zero_settings

        memo: dict[Any, Any] = cache if cache is not None else {}
        zkey = ("zero", plan.zero, d.pp > 1)
        z = memo.get(zkey)
        if z is None:
            z = memo[zkey] = zero_settings(plan)
        shape = activation_shape(plan)
        pkey = ("per-layer", shape, plan.spec.training.recompute)
        per = memo.get(pkey)
        if per is None:
            per = memo[pkey] = _PerLayer.of(plan, shape)
        m = micro_batches(plan)
        first = stage_memory(plan, 0, z, m, per).device_bytes
        if first > stop_above or d.pp == 1:
            return first
        return max(first, stage_memory(plan, d.pp - 1, z, m, per).device_bytes)
    except Exception:  # noqa: BLE001 - a bound is an optimisation: 0 leaves the decision to the full estimate
        return 0.0


def pass_floor_s(plan: Priced, stages: str = "all") -> float:
    """A lower bound of the step time from the estimate's own pass durations (`estimate_step` prices them with
    the same rates and simulates the schedule over them): rank 0 finishes its last backward no earlier than
    max_k (sum_{s<k} (F_s + B_s) + 2k t + m busy_k) (micro-batch 1's forward reaches stage k over k transfers
    of t seconds, stage k works m busy_k, the last backward returns over k more; F, B of chunk 0), and the
    step ends no earlier than that plus rank 0's tail (its exposed reductions, optimizer and engine step, the
    same `stage_tail`). 0 when the passes cannot be computed (the full estimate then decides alone).
    ``stages="edges"`` prices the first and last stage only: max(busy_0, F_0 + B_0 + 2(p-1)t + busy_last), the
    chain through them alone; ``"each"`` prices every stage on its own (what `_passes` shares between alike
    stages, for the tests)."""
    try:
        from dsforge.compiler.estimate import comm
        from dsforge.compiler.estimate.compute import rates
        from dsforge.compiler.estimate.steptime import stage_passes, stage_tail

        d, m = plan.degrees, plan.grad_accum
        if m is None:  # global_batch does not split: no chain to bound
            return 0.0
        peak = flops.dense_peak_flops(plan.spec.hardware.accelerator, plan.spec.training.precision)
        if peak <= 0:
            return 0.0
        rate = rates(plan, peak)
        pp_ops = [o for o in comm.pipeline_parallel(plan) if o.overlap == "dependency"] if d.pp > 1 else []
        t = pp_ops[0].seconds if pp_ops else 0.0  # what estimate_step's simulation adds per crossing
        if stages == "edges" and d.pp > 2:
            (f0, b0), (fl, bl) = stage_passes(plan, 0, rate), stage_passes(plan, d.pp - 1, rate)
            best = max(m * sum(x.seconds for x in f0 + b0), f0[0].seconds + b0[0].seconds + 2 * (d.pp - 1) * t
                       + m * sum(x.seconds for x in fl + bl))
        else:
            passes = [stage_passes(plan, s,
                                   rate) for s in range(d.pp)] if stages == "each" else _passes(plan, rate)
            best, lead = 0.0, 0.0
            for k, (fwd, bwd) in enumerate(passes):
                busy = m * sum(x.seconds for x in fwd + bwd)
                best = max(best, lead + 2 * k * t + busy)
                lead += fwd[0].seconds + bwd[0].seconds
            b0 = passes[0][1]
        return best + sum(stage_tail(plan, 0, b0[0].compute_s, rate.slowdown).values())
    except Exception:  # noqa: BLE001 - a bound is an optimisation: without it the search is slower, not wrong
        return 0.0


def _passes(plan: Priced, speed: Any) -> list[Any]:
    """`stage_passes` of every stage, priced once per kind of stage: a stage's passes follow from whether it
    is the first or the last (embedding, head, their parameters) and from the layers of each of its chunks
    (how many, how many MoE); the collectives of the other layers are the same on every stage
    (`comm.model_parallel`), and its data-parallel ones follow from its parameters (`comm.data_parallel`).
    Deep pipelines (pp = 64 for 405B) thus price three kinds of stage, not 64."""
    from dsforge.compiler.estimate.shares import stage_chunks
    from dsforge.compiler.estimate.steptime import stage_passes
    from dsforge.compiler.model.params import is_moe_layer

    pp, model = plan.degrees.pp, plan.model
    seen: dict[tuple[Any, ...], Any] = {}
    out = []
    for s in range(pp):
        chunks = tuple((count, sum(is_moe_layer(model, i) for i in range(first, first + count)))
                       for first, count in stage_chunks(plan, s))
        key = (s == 0, s == pp - 1, chunks)
        if key not in seen:
            seen[key] = stage_passes(plan, s, speed)
        out.append(seen[key])
    return out
