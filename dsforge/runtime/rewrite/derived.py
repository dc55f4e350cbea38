"""The rewrite policy of an HF model read from its own classes' parallel plans (dsforge.compiler.model.hf_plans).

Used for `arch: auto` when no hand-written family recognises the model: the model's configuration
class gives ``base_model_tp_plan``/``base_model_ep_plan``/``base_model_pp_plan`` and its class the head's
``_tp_plan``; each parameter owner the plan does not name is replicated, as HF's own tensor
parallelism does. The policy is registered under ``hf:<model_type>`` so the planner, plan.json and
explain name it.
"""

from __future__ import annotations

from torch import nn

from dsforge.compiler.model.hf_plans import (
    HfPlans,
    PlanRefusal,
    complete_rows,
    derive_policy,
    plans_from_classes,
)
from dsforge.compiler.model.rewrite_policies import POLICIES
from dsforge.runtime.rewrite.walk import match_rows


def hf_plans_of(model: nn.Module) -> HfPlans | None:
    """The plans of an HF PreTrainedModel (None for a module that is not one, or has no model_type)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not isinstance(model_type, str) or not model_type:
        return None
    return plans_from_classes(model_type, type(config), type(model))


def derived_arch(model: nn.Module) -> str:
    """Register the model's derived policy (leftover parameter owners replicated) and return its arch name.

    Raises PlanRefusal (DSF170/DSF171) when the plans cannot be placed exactly, and ValueError for a
    module that is not an HF model.
    """
    plans = hf_plans_of(model)
    if plans is None:
        raise ValueError("not an HF PreTrainedModel (no config.model_type): its classes state no parallel plan")
    derived = derive_policy(plans)
    walk = match_rows(model, [(f"{derived.policy.arch}[{i}]", r) for i, r in enumerate(derived.policy.rows)])
    policy = complete_rows(derived.policy, walk.leftover)
    POLICIES[policy.arch] = policy  # replaced on every build: the leftovers depend on the model's widths
    return policy.arch


__all__ = ["PlanRefusal", "derived_arch", "hf_plans_of"]
