"""One JSON-ready summary of a plan's estimates: parameters, FLOPs, memory, communication, bubble, time.

`dsforge explain --format json` prints it and `dsforge compile` embeds it in ``plan.json``; keys are
stable, units are in the key names (``_bytes``, ``_s``, ``_per_s``), fractions are 0-1.
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.estimate import comm, flops
from dsforge.compiler.estimate.comm import Collective
from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.estimate.shares import stage_chunks, stage_share
from dsforge.compiler.estimate.steptime import StepTime, estimate_step, refetched
from dsforge.compiler.model.params import is_moe_layer, layer_params, mlp_params, moe_layers_in, total_params
from dsforge.compiler.plan.bubble import bubble_fraction
from dsforge.compiler.plan.plan import ResolvedPlan

#: Layer-scoped collectives that a full recompute repeats during the backward pass.
_REPEATED_BY_RECOMPUTE = ("layer", "moe-layer")


def active_params(plan: ResolvedPlan) -> int:
    """Parameters one token passes through: every dense weight plus top_k of each MoE layer's experts."""
    model = plan.model
    total = total_params(model, plan.degrees.tp)
    if model.moe is None:
        return total
    idle = (model.moe.experts - model.moe.top_k) * mlp_params(model, model.moe.ffn_hidden)
    return total - idle * moe_layers_in(model, 0, model.layers)


def _units(plan: ResolvedPlan, stage: int, op: Collective, m: int) -> float:
    """Scope units of ``op`` per step on one rank of ``stage`` (layers x micro-batches and so on)."""
    model, last = plan.model, len(plan.stage_layers) - 1
    chunks = [(j * plan.degrees.pp + stage, first, n) for j,
              (first, n) in enumerate(stage_chunks(plan, stage))]
    full = plan.spec.training.recompute == "full" and op.phase == "forward" and (
        op.scope in _REPEATED_BY_RECOMPUTE or refetched(op))
    if op.scope == "layer":
        per_mb = float(sum(n for _, _, n in chunks))
    elif op.scope == "moe-layer":
        per_mb = float(sum(moe_layers_in(model, f, n) for _, f, n in chunks))
    elif op.scope in ("first", "last"):
        per_mb = float(any(k == (0 if op.scope == "first" else last) for k, _, _ in chunks))
    elif op.scope == "boundary":  # sends: forward out of every chunk but the last, backward out of all but
                                  # the first
        skip = last if op.phase == "forward" else 0
        per_mb = float(sum(k != skip for k, _, _ in chunks))
    elif op.scope == "micro-batch":
        per_mb = 1.0
    else:
        return 1.0 if op.group != "pp" or stage in (0, plan.degrees.pp - 1) else 0.0
    return per_mb * m * (2 if full else 1)


def communication_rows(plan: ResolvedPlan, stage: int, m: int) -> list[dict[str, Any]]:
    """Every collective one rank of ``stage`` runs in a step: size, link, bytes and time per step."""
    rows = []
    for op in comm.model_parallel(plan) + comm.data_parallel(plan, stage):
        units = _units(plan, stage, op, m)
        if units <= 0:
            continue
        rows.append({"group": op.group, "collective": op.op, "purpose": op.purpose, "phase": op.phase,
                     "group_size": op.group_size, "link": op.link.name, "payload_bytes": op.payload_bytes,
                     "calls_per_step": units * op.repeat, "sent_bytes_per_step": units * op.sent_bytes,
                     "time_per_step_s": units * op.seconds, "overlap": op.overlap})
    return rows


def _memory(mem: MemoryEstimate) -> dict[str, Any]:
    peak = mem.peak
    return {"capacity_bytes": mem.capacity_bytes, "peak_stage": peak.stage, "peak_rank": peak.rank,
            "peak_bytes": peak.device_bytes, "utilization": mem.utilization,
            "stages": [{"stage": s.stage, "rank": s.rank, "device_bytes": s.device_bytes,
                        "host_bytes": s.host_bytes, "components": dict(s.components),
                        "host": dict(s.host)} for s in mem.stages],
            "assumptions": list(mem.assumptions)}


def _time(plan: ResolvedPlan, step: StepTime, tokens: float | None) -> dict[str, Any]:
    train_tokens = tokens if tokens is not None else float(plan.spec.training.steps * step.tokens)
    return {"step_s": step.step_s, "compute_s": step.compute_s, "bubble_s": step.bubble_s,
            "exposed_comm_s": dict(step.comm_s), "optimizer_s": step.optimizer_s,
            "engine_s": step.engine_s,
            "critical_stage": step.critical_stage, "tokens_per_step": step.tokens,
            "tokens_per_s": step.tokens_per_s, "model_tflops_per_gpu": step.tflops_per_gpu,
            "hardware_tflops_per_gpu": step.hardware_flops / step.step_s / step.gpus / 1e12,
            "mfu": step.mfu, "hfu": step.hfu, "peak_tflops": step.peak_flops / 1e12,
            "achievable_fraction": step.achievable_fraction,
            "achievable_fraction_source": step.fraction_source, "train_tokens": train_tokens,
            "train_steps": train_tokens / step.tokens, "train_time_s": step.time_to_train(train_tokens)}


def _pipeline(plan: ResolvedPlan, step: StepTime) -> dict[str, Any]:
    p, m, v = plan.degrees.pp, plan.grad_accum, plan.virtual_stages
    return {"schedule": plan.spec.parallel.pipeline.schedule, "stages": p, "virtual_stages": v,
            "micro_batches": m, "stage_layers": list(plan.stage_layers),
            "bubble_fraction": step.timeline.bubble_fraction,
            "bubble_fraction_closed_form": bubble_fraction(p, m, v), "makespan_s": step.timeline.makespan,
            "timeline_exact": step.timeline.exact,
            "timeline_shown_micro_batches": step.timeline.shown_micro_batches,
            "stage_busy_s": [step.timeline.busy(s) for s in range(p)]}


def _params(plan: ResolvedPlan) -> dict[str, Any]:
    model, d = plan.model, plan.degrees
    shares = [stage_share(plan, s, 0.0) for s in range(d.pp)]
    return {"total": total_params(model, d.tp), "active_per_token": active_params(plan),
            "per_layer": layer_params(model, is_moe_layer(model, 0)).total,
            "per_gpu_by_stage": [{"stage": s, "dense": x.dense, "expert": x.expert} for s,
                                 x in enumerate(shares)]}


def checkpoint_summary(plan: ResolvedPlan) -> dict[str, Any]:
    """The `checkpoint` section (dsforge.compiler.estimate.checkpoint_size)."""
    from dsforge.compiler.estimate.checkpoint_size import checkpoint_summary as section

    return section(plan)


def summarize(plan: ResolvedPlan, tokens: float | None = None, step: StepTime | None = None,
              memory: MemoryEstimate | None = None) -> dict[str, Any]:
    """The JSON-ready estimate of a valid plan; ``tokens`` sets the training horizon (default: steps x
    batch)."""
    step = step or estimate_step(plan)
    memory = memory or estimate_memory(plan)
    d, spec, m = plan.degrees, plan.spec, plan.grad_accum
    rows = communication_rows(plan, step.critical_stage, m)
    return {
        "job": spec.name,
        "layout": {"nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node, "world_size": plan.world_size,
                   "tp": d.tp, "pp": d.pp, "dp": d.dp, "cp": d.cp, "ep": d.ep, "expert_dp": d.expert_dp,
                   "zero": plan.zero, "sequence_parallel": spec.parallel.sequence_parallel,
                   "global_batch": spec.training.global_batch, "micro_batch": spec.training.micro_batch,
                   "micro_batches": m, "seq_len": plan.model.seq_len, "precision": spec.training.precision,
                   "recompute": spec.training.recompute, "accelerator": spec.hardware.accelerator.name},
        "params": _params(plan),
        "flops": {"model_per_step": step.model_flops, "hardware_per_step": step.hardware_flops,
                  "model_per_token": flops.model_flops_per_token(plan.model, d.tp)},
        "memory": _memory(memory),
        "communication": {"stage": step.critical_stage, "collectives": rows, "exposed_s": dict(step.comm_s)},
        "pipeline": _pipeline(plan, step),
        "time": _time(plan, step, tokens),
        "checkpoint": checkpoint_summary(plan),  # disk bytes of one checkpoint and of the retention (issue
                                                 # 26)
    }
