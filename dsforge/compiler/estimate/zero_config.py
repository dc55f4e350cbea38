"""The DeepSpeed settings that size the model-state buffers: those of the ds_config dsforge emits.

Precedence, as in the emitted file: the job's `deepspeed.zero_optimization` overrides, then the
choices dsforge emits (`dsforge/compiler/deepspeed/ds_settings.py`), then DeepSpeed 0.19.8's defaults
(`deepspeed/runtime/zero/config.py` DeepSpeedZeroConfig): reduce_bucket_size 5e8 and
allgather_bucket_size 5e8 elements, contiguous_gradients on, overlap_comm on for stage 3 only,
stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold 1e5, stage3_max_live_parameters 1e9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsforge.compiler.deepspeed.ds_settings import emitted_zero_block
from dsforge.compiler.estimate.memo import plan_memo
from dsforge.compiler.plan.plan import AnyPlan

#: Bytes of optimizer state per parameter kept in fp32 (torch and DeepSpeed implementations).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lamb": 8, "lion": 4, "sgd": 4}


@dataclass(frozen=True)
class ZeroSettings:
    """Everything about ZeRO and precision that changes which buffers a rank keeps."""

    stage: int
    precision: str  # bf16 | fp16 | fp32
    weight_bytes: int  # bytes per element of the model's weights and gradients (2: bf16/fp16, 4: fp32)
    optimizer_bytes: int  # fp32 optimizer state per parameter
    offload_optimizer: bool
    offload_params: bool
    pipeline: bool
    reduce_bucket: float  # elements
    allgather_bucket: float
    contiguous_gradients: bool
    overlap_comm: bool
    prefetch_bucket: float
    persistence_threshold: float
    max_live_parameters: float
    fp32_grad_accum: bool  # data_types.grad_accum_dtype: fp32 with 16-bit weights


def _get(block: dict[str, Any], *names: str, default: Any) -> Any:
    for name in names:
        if name in block:
            return block[name]
    return default


def _size(block: dict[str, Any], *names: str, default: float) -> float:
    """A size override as a float; the default for one that is no finite number >= 0 (a string, NaN, 1e308):
    the rules report such a value (DSF516, DeepSpeed's own config check), the estimate must not raise on
    it."""
    value = _get(block, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    number = float(value) if abs(value) < 1e300 else math.inf
    return number if math.isfinite(number) and number >= 0 else default


def _offloaded(block: Any) -> bool:
    return isinstance(block, dict) and block.get("device", "none") in ("cpu", "nvme")


def zero_settings(plan: AnyPlan) -> ZeroSettings:
    """Resolve the ZeRO settings of a plan: its stage and precision, then the emitted ds_config's
    `zero_optimization` (with the job's overrides), then DeepSpeed's defaults for keys neither sets.

    The estimate must size the buffers of the config that will really run, so it reads dsforge's own
    choices (`ds_settings.emitted_zero_block`: buckets scaled to the model width, overlap_comm on
    accelerators) instead of DeepSpeed's defaults, which apply only to keys neither sets. Resolved once per
    plan (the memory and communication estimates of every stage ask).
    """
    memo = plan_memo(plan)
    z = memo.get("zero_settings")
    if z is None:
        z = memo["zero_settings"] = _zero_settings(plan)
    return z


def _zero_settings(plan: AnyPlan) -> ZeroSettings:
    spec, stage = plan.spec, plan.zero
    ds = spec.deepspeed if isinstance(spec.deepspeed, dict) else {}
    zo = emitted_zero_block(plan)
    opt = spec.training.optimizer
    weight_bytes = 4 if spec.training.precision == "fp32" else 2
    dtypes = ds.get("data_types", {})
    fp32_accum = isinstance(dtypes, dict) and dtypes.get("grad_accum_dtype") in ("fp32", "float32")
    return ZeroSettings(
        stage=stage,
        precision=spec.training.precision,
        weight_bytes=weight_bytes,
        optimizer_bytes=OPTIMIZER_STATE_BYTES.get(opt.name, 8),
        offload_optimizer=stage > 0 and (opt.offload != "none" or _offloaded(zo.get("offload_optimizer"))),
        offload_params=stage == 3 and _offloaded(zo.get("offload_param")),
        pipeline=plan.degrees is not None and plan.degrees.pp > 1,
        reduce_bucket=_size(zo, "reduce_bucket_size", default=5e8),
        allgather_bucket=_size(zo, "allgather_bucket_size", default=5e8),
        contiguous_gradients=bool(_get(zo, "contiguous_gradients", default=True)),
        overlap_comm=bool(_get(zo, "overlap_comm", default=stage == 3)),
        prefetch_bucket=_size(zo, "prefetch_bucket_size", "stage3_prefetch_bucket_size", default=5e7),
        persistence_threshold=_size(zo, "param_persistence_threshold", "stage3_param_persistence_threshold",
                                    default=1e5),
        max_live_parameters=_size(zo, "max_live_parameters", "stage3_max_live_parameters", default=1e9),
        fp32_grad_accum=fp32_accum and weight_bytes == 2,
    )
