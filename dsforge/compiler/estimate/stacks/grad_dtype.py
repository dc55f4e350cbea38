"""The gradient buffer's dtype by stack and `training.grad_reduce` (what model_states and comm price)."""

from __future__ import annotations

from dsforge.compiler.estimate.stacks import profile_of


def fp32_main_grads(stack: str, grad_reduce: str, weight_bytes: int, precision: str = "bf16") -> bool:
    """True when gradients accumulate and reduce in fp32 next to 16-bit weights: `grad_reduce: fp32`, or
    `auto` on a stack whose default it is with bf16 or fp8 (Megatron-Core:
    megatron/training/arguments.py:1213-1216 sets accumulate_allreduce_grads_in_fp32 inside its `if
    args.bf16:` block unless --grad-reduce-in-bf16; param_and_grad_buffer.py takes grad_dtype from it). Under
    fp16 that flag keeps its store_true default (off), so Megatron accumulates and all-reduces fp16 gradients.
    fp32 weights have fp32 gradients anyway (returns False: nothing is added)."""
    if weight_bytes == 4:
        return False
    if grad_reduce == "auto":
        return profile_of(stack).fp32_main_grads and precision != "fp16"
    return grad_reduce == "fp32"
