"""The job keys, beyond `stack:`, that change a stack's model states: the gradient dtype and the FP8
recipe."""

from __future__ import annotations

from dsforge.compiler.estimate.stacks.grad_dtype import fp32_main_grads
from dsforge.compiler.spec.schema import JobSpec


def stack_options(spec: JobSpec, weight_bytes: int) -> tuple[bool, str | None]:
    """(fp32 main gradients, the FP8 recipe or None) of a job, as `memory._stage_states` takes them."""
    t = spec.training
    recipe = (t.fp8_recipe or "delayed") if t.precision == "fp8" else None
    return fp32_main_grads(spec.stack, t.grad_reduce, weight_bytes, t.precision), recipe
