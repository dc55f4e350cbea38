"""The DeepSpeed engine's own host work per step: hooks, bucketing, the optimizer tensor by tensor.

Besides the model's operations (priced in `compute.py`), a DeepSpeed engine runs Python per micro-batch
(engine.forward/backward/step bookkeeping; ZeRO-1/2's gradient hook per parameter, which copies each
gradient into its reduction bucket, stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``;
ZeRO-3's per-module pre/post hooks that fetch and release every partitioned parameter,
partitioned_param_coordinator.py) and per optimizer step (the optimizer over each tensor at ZeRO-0,
un-flattening and clipping at ZeRO-1/2, the partitioned step at ZeRO-3). Its cost is
``step_us + T x tensor_step_us`` per step plus ``micro_batch_us + T x tensor_micro_batch_us`` per
micro-batch, T the parameter tensors the rank holds, each term by ZeRO stage: `dsforge calibrate` measures
them on the machine by timing real engine steps of a tiny model at two depths and two accumulation counts
(``hardware.engine_overhead``). It is host time on the critical path of a CPU rank (and of a GPU rank
whose kernels are shorter than the launches); a hardware file without the section prices none of it.
Only stack `dsforge` runs a DeepSpeed engine; the other stacks' host work is not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.shares import gathered_tensors, layer_kinds
from dsforge.compiler.model.params import has_bias
from dsforge.compiler.plan.plan import Priced


@dataclass(frozen=True)
class EngineOverhead:
    """Seconds of engine host work on one rank: per micro-batch and once per step."""

    micro_batch_s: float
    step_s: float
    tensors: int


def rank_tensors(plan: Priced, stage: int) -> int:
    """Parameter tensors one rank of ``stage`` holds (each has its own gradient hook and optimizer entry)."""
    d, model = plan.degrees, plan.model
    count = 0
    for moe, layers in layer_kinds(plan, stage).items():
        dense, expert = gathered_tensors(model, moe, d.tp, d.ep, -1.0)
        count += layers * (dense + expert)
    if stage == 0:
        count += 2 if model.position == "learned" else 1
    if stage == d.pp - 1:
        norm = 2 if has_bias(model) else 1  # a LayerNorm's bias
        count += norm + (0 if model.tied_embeddings and d.pp == 1 else 1)
    return count


def engine_overhead(plan: Priced, stage: int) -> EngineOverhead:
    """The engine host time of one rank of ``stage`` (zero when the hardware states no engine_overhead)."""
    hw = plan.spec.hardware
    tensors = rank_tensors(plan, stage)
    cost = hw.engine_overhead
    if cost is None or plan.spec.stack != "dsforge":
        return EngineOverhead(0.0, 0.0, tensors)
    z = min(3, max(0, plan.zero))
    micro = (cost.micro_batch_us[z] + tensors * cost.tensor_micro_batch_us[z]) * 1e-6
    step = (cost.step_us[z] + tensors * cost.tensor_step_us[z]) * 1e-6
    return EngineOverhead(micro, step, tensors)
