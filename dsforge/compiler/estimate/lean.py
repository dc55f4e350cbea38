"""The saved-tensor profile of a job's stack, with dsforge's lean kernels (`training.kernels`) where they run.

Stack `dsforge` starts from `activations.HF_SDPA` (the plain HF modules) and replaces what each lean kernel
of `dsforge.compiler.model.lean_kernels` changes, term by term (measured:
tests/compiler/estimate/test_memory_measured.py, the runtime's model; tests/runtime/test_lean_kernels.py, each
kernel alone):

* ``norm``: HF's RMSNorm keeps its input and an fp32 rstd (dsforge/runtime/kernels/norms.py), not the fp32
  copy and the normalised output: `Kernels.hf_rmsnorm` False (LayerNorm families: no change);
* ``swiglu``: gate and up saved by the Function, the product by the down projection: 3 f-wide tensors for a
  dense MLP, a shared expert or dsforge's routed experts (runtime/kernels/swiglu.py; Megatron's SwiGLUFunction
  keeps the same); HF's own experts module (ep = 1: not replaced) keeps plain ops (4);
* ``gelu``: gelu_new's input and the output projection's input: 2 (runtime/kernels/gelu.py);
* ``fused_loss``: no full-vocabulary fp32 logits; the fp32 row maximum and sum of exponentials and the target
  per token, one chunk of logits at a time (runtime/kernels/fused_ce.py): `Kernels.fp32_logits` False,
  `chunked_loss` True.

Another stack's profile is its own (`stacks/`); the job's kernels do not change it.
"""

from __future__ import annotations

from dataclasses import replace

from dsforge.compiler.estimate.activations import Kernels
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.model.lean_kernels import KERNELS, lean_kernels
from dsforge.compiler.plan.plan import AnyPlan, Plan, Priced


def requested_kernels(plan: AnyPlan) -> dict[str, bool | str]:
    """The job's `training.kernels` values (auto, true or false) by kernel name."""
    spec = getattr(plan.spec.training, "kernels", None)
    return {k: getattr(spec, k, "auto") for k in KERNELS}


def stack_kernels(plan: Priced) -> Kernels:
    """The `Kernels` the job's stack runs: for dsforge, HF's modules with the job's lean kernels swapped
    in."""
    base = profile_of(plan.spec.stack, plan.spec.training.attention).kernels
    if plan.spec.stack != "dsforge":
        return base
    on = lean_kernels(plan.model, requested_kernels(plan), plan.degrees.pp)
    return replace(
        base,
        hf_rmsnorm=base.hf_rmsnorm and "norm" not in on,
        swiglu_tensors=3 if "swiglu" in on else base.swiglu_tensors,
        expert_swiglu_tensors=(3 if experts_converted(plan) else base.swiglu_tensors)
        if "swiglu" in on
        else base.expert_swiglu_tensors,
        gelu_tensors=2 if "gelu" in on else base.gelu_tensors,
        fp32_logits=base.fp32_logits and "fused_loss" not in on,
        chunked_loss="fused_loss" in on,
    )


def experts_converted(plan: Priced) -> bool:
    """True when the runtime replaces HF's routed experts with its own (dsforge/runtime/moe.py GatedExpert,
    which the lean SwiGLU serves): only for ep > 1 (rewrite/apply.py `_moe_block`); at ep = 1 HF's experts
    module stays whole and runs its own loop of plain ops."""
    return plan.degrees.ep > 1


def lean_note(plan: Priced) -> str:
    """The memory table's note on what stack dsforge's activations assume: SDPA and the lean kernels that
    run."""
    on = lean_kernels(plan.model, requested_kernels(plan), plan.degrees.pp)
    lean = ", ".join(k for k in KERNELS if k in on)
    return ("activations: dsforge's HF models (SDPA flash attention, no dropout) with lean kernels: "
            + (lean or "none") + " (training.kernels)")


def plain_kernels(plan: AnyPlan) -> Plan:
    """The plan with every lean kernel off: what a model trained outside dsforge's runtime keeps (the trainer
    plugins train the user's own HF modules and loss, so their memory report predicts with this plan)."""
    from dsforge.compiler.plan.plan import build_plan

    t = plan.spec.training
    off = t.kernels.model_copy(update=dict.fromkeys(KERNELS, False))
    return build_plan(plan.spec.model_copy(update={"training": t.model_copy(update={"kernels": off})}))
