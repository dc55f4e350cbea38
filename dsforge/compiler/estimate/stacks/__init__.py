"""Stack profiles: what the implementation that runs a job keeps, moves and launches (the job's `stack:` key).

A profile states, each with its source, the kernels' saved activations (`activations.Kernels`), whether the
pipeline keeps each stage's output, whether experts are split over TP, the optimizer-state layout and
gradient dtype, and the memory-bound traffic and framework operations of a layer that the step-time model
(`estimate/compute.py`) prices. `profile_of(plan)` picks the job's.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from dsforge.compiler.estimate.stacks.profile import StackProfile

__all__ = ["StackProfile", "profile_of"]


@lru_cache(maxsize=16)
def profile_of(stack: str, attention: str = "auto") -> StackProfile:
    """The profile of a `stack:` value (the schema admits only known names) with the job's
    `training.attention` kernel (auto: the stack's own); the profiles' modules are imported on first use
    only."""
    from dsforge.compiler.estimate.stacks import dsforge_runtime, megatron_deepspeed, megatron_te

    base = {"dsforge": dsforge_runtime.PROFILE, "megatron-te": megatron_te.PROFILE,
            "megatron-deepspeed": megatron_deepspeed.PROFILE}[stack]
    if attention == "auto":
        return base
    return replace(base, kernels=replace(base.kernels, fused_attention=attention == "flash"))
