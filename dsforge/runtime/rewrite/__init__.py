"""Module rewrites: the rewrite plan (which module becomes which parallel variant) and its application.

``plan_rewrite`` and ``describe`` build the model on the ``meta`` device and return plain data;
``apply_rewrite`` (dsforge.runtime.rewrite.apply) swaps a real model's modules for their parallel
variants according to that plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import AnyPlan
from dsforge.compiler.spec.schema import JobSpec, ModelSpec
from dsforge.runtime.models import ModelBuildError, build_model
from dsforge.runtime.rewrite.derived import PlanRefusal, derived_arch, hf_plans_of, prefers_derived
from dsforge.runtime.rewrite.detect import detect_arch
from dsforge.runtime.rewrite.planner import ModulePlan, RewriteError, RewritePlan, plan_module


def resolve_arch(model: nn.Module, spec: JobSpec) -> str:
    """The policy to use: the spec's arch, `custom` (job rules only), or the family `auto` recognises."""
    arch = spec.model.arch
    if arch == "custom":
        if not spec.rewrite:
            raise RewriteError("custom", [("arch: custom places modules only by the job's `rewrite:` rules, "
                                           "and the job has none")])
        return arch
    if arch != "auto":
        return arch
    derived_problem = None
    if prefers_derived(model):
        try:  # an HF model of a type no hand-written family lists: the policy its own tp/ep plans state
            return derived_arch(model)
        except PlanRefusal as exc:
            derived_problem = str(exc)
    found, reasons = detect_arch(model, list(spec.rewrite))
    if derived_problem is not None:
        reasons[f"hf:{hf_plans_of(model).model_type}"] = derived_problem  # type: ignore[union-attr]
    if found is None:
        raise RewriteError("auto", [f"arch: auto recognises none of the families: {a}: {r}"
                                    for a, r in reasons.items()] +
                           ["set model.arch: custom and give `rewrite:` rules for the model's modules"])
    return found


def plan_rewrite(source: ModelSpec | ResolvedModel | nn.Module, plan: AnyPlan) -> RewritePlan:
    """The rewrite plan of a module (or of the spec's model, built on the meta device) under ``plan``."""
    d = plan.degrees
    model = source if isinstance(source, nn.Module) else build_model(source, "meta", d.tp if d else 1)
    return plan_module(model, plan, resolve_arch(model, plan.spec))


def describe(spec: JobSpec, plan: AnyPlan) -> dict[str, Any]:
    """The rewrite plan as JSON-ready data for plan.json and `dsforge explain`; never raises on a bad job.

    ``ok`` is False when the model cannot be built or placed; ``errors`` then says why and
    ``leftover`` names the modules no rule placed. ``plan`` must be ``build_plan(spec)``.
    """
    try:
        rp = plan_rewrite(plan.model, plan)
    except RewriteError as exc:
        return {"ok": False, "arch": exc.arch, "errors": exc.problems, "leftover": exc.leftover}
    except ModelBuildError as exc:
        return {"ok": False, "arch": spec.model.arch, "errors": [str(exc)], "leftover": []}
    out: dict[str, Any] = {"ok": True, **rp.to_dict()}
    if not spec.model.factory:
        tp = plan.degrees.tp if plan.degrees else 1
        out["params"]["formula_total"] = total_params(plan.model, tp)
    return out


__all__ = ["ModulePlan", "RewriteError", "RewritePlan", "describe", "detect_arch", "plan_rewrite",
           "resolve_arch"]
