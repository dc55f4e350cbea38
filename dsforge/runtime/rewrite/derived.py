"""The rewrite policy of an HF model read from its own classes' parallel plans
(dsforge.compiler.model.hf_plans).

Used for `arch: auto` when no hand-written family recognises the model: the model's configuration
class gives ``base_model_tp_plan``/``base_model_ep_plan``/``base_model_pp_plan`` and its class the head's
``_tp_plan``; each parameter owner the plan does not name is replicated, as HF's own tensor
parallelism does. The policy is registered under ``hf:<model_type>`` so the planner, plan.json and
explain name it.
"""

from __future__ import annotations

import re

from torch import nn

from dsforge.compiler.model.hf_plans import (
    SPLIT_NEIGHBOUR,
    HfPlans,
    PlanRefusal,
    complete_rows,
    derive_policy,
    plans_from_classes,
)
from dsforge.compiler.model.rewrite_policies import FAMILIES, POLICIES, Policy, PolicyRow
from dsforge.runtime.rewrite.walk import match_rows


def prefers_derived(model: nn.Module) -> bool:
    """True for an HF model whose model_type no hand-written family lists: its own plan places it first."""
    plans = hf_plans_of(model)
    return plans is not None and all(plans.model_type not in types for types in FAMILIES.values())


def hf_plans_of(model: nn.Module) -> HfPlans | None:
    """The plans of an HF PreTrainedModel (None for a module that is not one, or has no model_type)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not isinstance(model_type, str) or not model_type:
        return None
    return plans_from_classes(model_type, type(config), type(model))


def derived_arch(model: nn.Module) -> str:
    """Register the model's derived policy (leftover parameter owners replicated) and return its arch name.

    Raises PlanRefusal (DSF170/DSF171) when the plans cannot be placed exactly, DSF172 when a parameter
    owner the plan leaves unlisted sits beside a module it splits (an activation's learnt parameters
    between a column and a row split: replicated, its gradient would cover this rank's channels only),
    and ValueError for a module that is not an HF model.
    """
    plans = hf_plans_of(model)
    if plans is None:
        raise ValueError("not an HF PreTrainedModel (no config.model_type): "
                         "its classes state no parallel plan")
    derived = derive_policy(plans)
    walk = match_rows(model, [(f"{derived.policy.arch}[{i}]", r) for i, r in enumerate(derived.policy.rows)])
    split = [c.name for c in walk.claims if c.row.variant in ("column", "row")]
    beside = [(left,
               c) for left in walk.leftover for c in split if c.rpartition(".")[0] == left.rpartition(".")[0]]
    # learnt scalars of an elementwise function between the splits (the plan splitting both sides says it is
    # elementwise): replicated, their gradient summed over TP
    scalars = sorted({left for left, _ in beside if _only_scalars(model.get_submodule(left))})
    beside = [(left, c) for left, c in beside if left not in scalars]
    if beside:
        left, c = beside[0]
        raise PlanRefusal(SPLIT_NEIGHBOUR, f"model_type {plans.model_type!r}: {left} holds parameters the HF "
                          f"plan does not name, beside {c}, which the plan splits: replicated, it would see "
                          f"this rank's part of the activations and its gradient "
                          "would be partial (HF's plan has the same gap)",
                          "run it at tp=1, or place that module with "
                          "`rewrite:` rules under model.arch: custom")
    why = "learnt scalars of an elementwise function on split channels (HF: replicated): gradient summed, TP"
    policy = _with_rows(_head_norms(derived.policy, walk, model),
                        tuple(PolicyRow(re.escape(n), "scalars", why=why) for n in scalars))
    policy = complete_rows(policy, [n for n in walk.leftover if n not in scalars])
    POLICIES[policy.arch] = policy  # replaced on every build: the leftovers depend on the model's widths
    return policy.arch


#: Query/key norms by the names HF gives them: applied per head after the projection is viewed as heads.
_QK_NORM = re.compile(r"(?:q|k|query|key)_(?:norm|layernorm|ln)")


def _head_norms(policy: Policy, walk: object, model: nn.Module) -> Policy:
    """The policy with a ``head_norm`` row for each q/k norm beside a column split the plan leaves a plain
    norm.

    HF replicates such a norm (Sarvam-MoE's q_norm) and each rank normalises only its own heads, so the
    gradient must be summed over TP; ``head_norm`` does that, and refuses (in the planner) a norm whose
    weight is not one head's width (a norm over the whole projection, which a head split cannot reproduce).
    """
    claims = getattr(walk, "claims", [])
    columns = {c.name.rpartition(".")[0] for c in claims if c.row.variant == "column"}
    names = [c.name for c in claims if c.row.variant == "norm" and c.name.rpartition(".")[0] in columns
             and _QK_NORM.fullmatch(c.name.rpartition(".")[2])
             and any(True for _ in model.get_submodule(c.name).parameters(recurse=False))]
    # a norm without a weight (NanoChat's) has no gradient to sum: it stays a plain norm
    why = "per-head q/k norm beside a head split (HF: replicated): replicated, its gradient summed over TP"
    return _with_rows(policy, tuple(PolicyRow(re.escape(n), "head_norm", why=why) for n in names))


def _with_rows(policy: Policy, rows: tuple[PolicyRow, ...]) -> Policy:
    """The policy with ``rows`` matched before its own."""
    if not rows:
        return policy
    return Policy(arch=policy.arch, rows=rows + policy.rows, layers=policy.layers, signature=policy.signature,
                  attr_scales=policy.attr_scales, absent=policy.absent,
                  sequence_parallel=policy.sequence_parallel)


def _only_scalars(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.numel() == 1 for p in params)


__all__ = ["PlanRefusal", "derived_arch", "hf_plans_of", "prefers_derived"]
