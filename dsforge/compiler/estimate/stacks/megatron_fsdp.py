"""Megatron-Core's model states at zero 2/3 (Megatron-FSDP) and Transformer Engine's FP8 weight caches.

zero 2 is Megatron-FSDP's `optim_grads` (optimizer state and the main-grad buffer sharded over dp x cp),
zero 3 its `optim_grads_params` (the 16-bit weights too, each FSDP unit all-gathered before use, the next one
prefetched): NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel_config.py:103
(data_parallel_sharding_strategy) and megatron/core/distributed/fsdp/ (the unit is one transformer layer).
The sharding group is dp x cp (distributed_data_parallel.py:148-149, intra_dp_cp_group).

FP8 (Transformer Engine): weights stay in bf16 and each GEMM casts them; across the micro-batches of a step
TE caches the cast weight (Megatron passes is_first_microbatch; transformer_engine/pytorch/module/linear.py
keeps the FP8 weight and, on Hopper, its transpose for the backward): 2 bytes per linear parameter, plus
one scale per 32 elements per copy for MXFP8 (transformer_engine/pytorch/tensor/mxfp8_tensor.py).
"""

from __future__ import annotations

#: bytes per parameter of TE's cached FP8 weights (the row-wise copy and the column-wise/transposed one)
FP8_WEIGHT_CACHE = {"delayed": 2.0, "current": 2.0, "blockwise": 2.0 + 2 * 4 / 128 / 128,
                    "mxfp8": 2.0 + 2 / 32}


def fsdp_parts(stage: int, weight_bytes: int, grad_bytes: int, params: float, partition: float,
               largest_module: float) -> tuple[float, float, float]:
    """(parameter bytes, gradient bytes, gathered-buffer bytes) of one rank at zero ``stage`` under
    Megatron-Core: 1 shards the optimizer only (the distributed optimizer); 2 also the main-grad buffer;
    3 also the weights, with the gathered unit and the prefetched next one (2 x the largest layer)."""
    weights = weight_bytes * params
    grads = grad_bytes * params
    gathered = 0.0
    if stage >= 2:
        grads = grad_bytes * partition
    if stage >= 3:
        weights = weight_bytes * partition
        gathered = 2 * weight_bytes * largest_module
    return weights, grads, gathered


def fp8_cache_bytes(recipe: str | None, linear_params: float) -> float:
    """Bytes of the FP8 weight copies TE keeps for the step (0 without FP8)."""
    return 0.0 if recipe is None else FP8_WEIGHT_CACHE[recipe] * linear_params
