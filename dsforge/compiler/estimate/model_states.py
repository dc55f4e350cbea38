"""Model-state bytes of one rank: weights, gradients, optimizer state and DeepSpeed's own buffers.

The split into 16-bit weights + 16-bit gradients + fp32 master weights + fp32 optimizer moments is
Rajbhandari et al. 2020 (ZeRO), sec. 3.1 (2 + 2 + 12 bytes per parameter for mixed-precision Adam),
partitioned over the data-parallel ranks by stage (their eq. in sec. 5: stage 1 divides the 12 bytes,
stage 2 also the gradients, stage 3 also the weights). Which buffers DeepSpeed 0.19.8 really keeps
was read from its source and measured (tests/test_memory_states.py):

* no ZeRO, fp32: the torch optimizer on the model's own tensors (weights, .grad, moments);
* no ZeRO, 16-bit: `runtime/fp16/fused_optimizer.py` FP16_Optimizer (and the unfused variant) keeps a
  full fp32 master copy and, at the step, full fp32 gradients next to the 16-bit .grad;
* bf16 with a pipeline (no ZeRO), or ZeRO-1 with `data_types.grad_accum_dtype: fp32`:
  `runtime/bf16_optimizer.py` BF16_Optimizer: a full flat gradient-accumulation buffer and an fp32
  master *partition*;
* ZeRO 1/2: `runtime/zero/stage_1_and_2.py` DeepSpeedZeroOptimizer: the weights flattened into one
  buffer, an fp32 master partition (cloned even for fp32 training), fp32 gradients of the partition
  built at the step, full .grad (stage 1) or a contiguous partition buffer (stage 2), and
  reduce_bucket_size-element bucket(s) (two with overlap_comm) while gradients are reduced;
* ZeRO 3: `runtime/zero/stage3.py` DeepSpeedZeroOptimizer_Stage3: weight partitions, tensors at or
  below the persistence threshold kept whole, the gathered working set (the largest module plus the
  prefetch bucket, capped by max_live_parameters), a gradient partition buffer and a reduce bucket.

CPU offload (ZeRO-Offload, Ren et al. 2021) moves the fp32 master, moments and fp32 gradients to the
host; they are reported under `host`, not against device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsforge.compiler.estimate.shares import RankParams
from dsforge.compiler.estimate.zero_config import ZeroSettings

FP32 = 4


@dataclass
class ModelStates:
    """Device and host bytes of the model states of one rank, by component name."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)


def _partition(share: RankParams, n_dense: int, n_expert: int) -> float:
    """Parameters in this rank's ZeRO partition: dense ones over dp x cp, expert ones over expert-dp."""
    return share.dense / n_dense + share.expert / n_expert


def uses_bf16_optimizer(z: ZeroSettings) -> bool:
    """True when DeepSpeed wraps the optimizer in BF16_Optimizer (engine `_do_optimizer_sanity_check`)."""
    if z.weight_bytes != 2 or z.stage > 1:
        return False
    if z.stage == 1:
        return z.fp32_grad_accum and not z.offload_optimizer
    return z.pipeline and z.precision == "bf16"


def model_states(share: RankParams, z: ZeroSettings, n_dense: int, n_expert: int) -> ModelStates:
    """Bytes of weights, gradients, optimizer state and ZeRO buffers one rank keeps (see module doc)."""
    p, b, k = share.total, z.weight_bytes, z.optimizer_bytes
    pn = _partition(share, n_dense, n_expert)
    if z.stage == 0 and not uses_bf16_optimizer(z):
        return _no_zero(p, b, k)
    if uses_bf16_optimizer(z):
        accum = FP32 if z.fp32_grad_accum else b
        return ModelStates({"parameters": b * p, "gradients": accum * p, "optimizer": (FP32 + k) * pn})
    if z.stage in (1, 2):
        return _zero12(p, pn, b, k, z)
    return _zero3(share, pn, b, k, z)


def _no_zero(p: float, b: int, k: int) -> ModelStates:
    """No ZeRO: fp32 trains in place; 16-bit keeps a full fp32 master and fp32 gradients (FP16_Optimizer)."""
    if b == FP32:
        return ModelStates({"parameters": FP32 * p, "gradients": FP32 * p, "optimizer": k * p})
    return ModelStates({"parameters": b * p, "gradients": (b + FP32) * p, "optimizer": (FP32 + k) * p})


def _buckets(z: ZeroSettings) -> float:
    """Gradient reduction bucket(s) of reduce_bucket_size elements: two with overlap_comm, none without
    contiguous_gradients (`setup_buckets` in stage_1_and_2.py)."""
    if not z.contiguous_gradients:
        return 0.0
    return z.reduce_bucket * z.weight_bytes * (2 if z.overlap_comm else 1)


def _zero12(p: float, pn: float, b: int, k: int, z: ZeroSettings) -> ModelStates:
    """ZeRO 1/2 (DeepSpeedZeroOptimizer): flat weights, fp32 master partition, partitioned moments."""
    grads16 = b * p if z.stage == 1 else b * pn
    dev = {"parameters": b * p, "gradients": grads16, "optimizer": 0.0, "buffers": _buckets(z)}
    host: dict[str, float] = {}
    if z.offload_optimizer:
        # the fp32 master, moments and fp32 gradient partition live in pinned host memory; the device
        # keeps a 16-bit copy of the partition for the all-gather (param_buffer_of_bit16_for_cpu_offload)
        host = {"optimizer": (FP32 + k) * pn, "gradients": FP32 * pn}
        dev["buffers"] += b * pn
    else:
        dev["gradients"] += FP32 * pn
        dev["optimizer"] = (FP32 + k) * pn
    return ModelStates(dev, host)


def _zero3(share: RankParams, pn: float, b: int, k: int, z: ZeroSettings) -> ModelStates:
    """ZeRO 3: weight partitions plus persistent small tensors; gathered working set and buckets."""
    gathered = min(z.max_live_parameters, share.largest_module + z.prefetch_bucket) * b
    params = b * pn + b * share.small
    dev = {"parameters": params, "gradients": b * pn, "optimizer": 0.0,
           "buffers": gathered + z.reduce_bucket * b}
    host: dict[str, float] = {}
    if z.offload_params:
        host["parameters"] = b * pn
        dev["parameters"] = b * share.small
    if z.offload_optimizer:
        host.update({"optimizer": (FP32 + k) * pn, "gradients": FP32 * pn})
    else:
        dev["gradients"] += FP32 * pn
        dev["optimizer"] = (FP32 + k) * pn
    return ModelStates(dev, host)
