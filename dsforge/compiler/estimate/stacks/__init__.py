"""Stack profiles: what the implementation that runs a job keeps, moves and launches (the job's `stack:` key).

A profile states, each with its source, the kernels' saved activations (`activations.Kernels`), whether the
pipeline keeps each stage's output, whether experts are split over TP, the optimizer-state layout and
gradient dtype, and the memory-bound traffic and framework operations of a layer that the step-time model
(`estimate/compute.py`) prices. `profile_of(plan)` picks the job's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dsforge.compiler.estimate.activations import Kernels


@dataclass(frozen=True)
class StackProfile:
    """One implementation's memory and time characteristics (see the module doc; sources in `sources`)."""

    name: str
    kernels: Kernels
    pipeline_output_buffers: bool  # the pipeline engine keeps each in-flight chunk's output until its backward
    experts_split_over_tp: bool  # expert matrices split over the tensor-parallel group (else whole per TP rank)
    distributed_optimizer: bool  # fp32 master weights and moments sharded over data parallelism at any zero
    fp32_main_grads: bool  # gradients accumulate and reduce in an fp32 buffer next to the 16-bit weights
    # bytes one token moves through memory-bound kernels per layer forward: (h_bytes x e + h_fp32_bytes) x h
    # + f_bytes x e x ffn, e the activations' element bytes; the backward moves twice as much
    h_bytes: float
    h_fp32_bytes: float
    f_bytes: float
    ce_bytes: float  # bytes per logit cell (token x vocab/tp) the loss moves, forward and backward together
    ops_forward: int  # framework operations one layer's forward dispatches
    ops_backward: int  # and its backward
    sources: tuple[str, ...]


@lru_cache(maxsize=8)
def profile_of(stack: str) -> StackProfile:
    """The profile of a `stack:` value (the schema admits only known names); the import runs once per name,
    inside the function because the profiles' modules import `StackProfile` from this one."""
    from dsforge.compiler.estimate.stacks import dsforge_runtime, megatron_te

    return {"dsforge": dsforge_runtime.PROFILE, "megatron-te": megatron_te.PROFILE}[stack]
