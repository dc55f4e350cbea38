"""DSF050: a lean runtime kernel the job requires (`training.kernels.<name>: true`) that cannot run exactly.

The runtime never approximates: a kernel that would compute something else for this family or layout
(Gemma's soft-capped logits, its (1 + weight) RMSNorm, its GELU gate; whole logits at the pipeline's last
stage) is off under `auto`; a job that says `true` is refused here rather than trained differently.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.model.lean_kernels import refused_kernels
from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, rule


@rule("DSF050", "a required lean kernel (training.kernels) cannot run exactly for this model or layout",
      source="dsforge/compiler/model/lean_kernels.py kernel_problem; dsforge/runtime/kernels", reads=("pp",),
      stacks=DSFORGE_RUNTIME)
def kernel_exact(ctx: Context) -> Iterator[Finding]:
    """Each `true` kernel must be exact for the model's family at this layout (see `lean_kernels`)."""
    d = ctx.plan.degrees
    if d is None or getattr(ctx.spec, "stack", "dsforge") != "dsforge":
        return
    kernels = ctx.spec.training.kernels
    asked = {k: getattr(kernels, k) for k in ("fused_loss", "swiglu", "gelu", "norm")}
    for name, why in refused_kernels(ctx.plan.model, asked, d.pp).items():
        yield Finding(f"training.kernels.{name} is true, but {why}",
                      f"set training.kernels.{name}: auto (on only where it is exact) or false",
                      ("training", "kernels", name))
