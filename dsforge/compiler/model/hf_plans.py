"""Rewrite policies derived from an HF model's own tensor-, pipeline- and expert-parallel plans (no torch).

transformers states, per model type, which module is split how: the configuration class's
``base_model_tp_plan`` (module path with ``*`` for the layer index -> one of the styles registered in
``transformers/distributed/tensor_parallel.py``), ``base_model_ep_plan`` (``grouped_gemm``,
``ep_dispatch_experts``), ``base_model_pp_plan`` (the stages), and the causal-LM class's ``_tp_plan``
for the head. ``HfPlans`` holds them; ``plans_for_type`` reads them from the generated table
(dsforge/compiler/model/hf_plans_table.py, so validate needs only config.json's ``model_type``) and
``plans_from_classes`` from the classes themselves when the runtime has transformers.

``derive_policy`` maps every style to the dsforge variant with the same mathematics (``STYLES``), or
raises ``PlanRefusal`` (DSF170) naming the module, its style and why. What HF leaves unlisted is
replicated by HF; dsforge places it the same way, except the token embedding (first pipeline stage),
which becomes vocab-parallel (exact: a vocab-parallel lookup sums to the whole row), and norms, which
become ``norm`` (replicated; their gradient summed over TP only under sequence parallelism). The
runtime adds a ``replicate`` row for each leftover parameter owner (``complete_rows``), as HF does.

Head kinds are not in the plan: a column split of a projection that is reshaped into heads must fall
on whole heads, so ``_HEAD_NAMES`` names the usual projections (q, k/v, o) and the planner checks whole
heads per rank for them (DSF104's condition); a colwise module inside attention with another name gets
no head check and is listed in ``DerivedPolicy.unchecked``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsforge.compiler.model.hf_plans_table import PLANS, TRANSFORMERS_VERSION
from dsforge.compiler.model.rewrite_policies import HeadKind, Policy, PolicyRow, Variant

_P = r"(?:.+\.)?"

#: Rule ids of this module (registered in dsforge/compiler/rules/hf_plans.py).
STYLE_REFUSED = "DSF170"
NO_PLAN = "DSF171"
SPLIT_NEIGHBOUR = "DSF172"
NO_PP_PLAN = "DSF173"
#: The base_model_pp_plan pieces dsforge's derived pipeline stages are built from
#: (dsforge.runtime.hf_pipeline; the head, ``lm_head``, is the causal-LM class's).
PP_PLAN_KEYS = ("embed_tokens", "layers", "norm")

#: HF style -> (dsforge variant, fused blocks, why); None: refused, with the reason.
STYLES: dict[str, tuple[Variant, int, str] | str] = {
    "colwise": ("column", 1, "weight split along its output features; its consumer is rowwise"),
    "rowwise": ("row", 1, "weight split along its input features; the partial outputs are summed"),
    "packed_colwise": ("column", 2, "packed [gate | up]: each block split on its own"),
    "embedding_rowwise": ("vocab", 1, "embedding split over the vocabulary; the partial lookups are summed"),
    "replicated_with_grad_allreduce": ("head_norm", 1, ("replicated; each rank sees its own heads, so its "
                                                        "gradient is summed over TP")),
    "sequence_parallel": ("norm", 1, ("replicated norm; under sequence parallelism "
                                      "its gradient is summed over TP")),
    "replicate": ("replicate", 1, "kept whole on every rank"),
    # HF computes these on every rank (input or output gathered): the same mathematics as a replicated module.
    "colwise_gather_output": ("replicate", 1, ("split then gathered by HF: kept "
                                               "whole (exact; memory not divided)")),
    "colwise_rep": ("replicate", 1, "split then gathered by HF: kept whole (exact; memory not divided)"),
    "rowwise_split_input": ("replicate", 1, ("input split then summed by HF: kept "
                                             "whole (exact; memory not divided)")),
    "rowwise_rep": ("replicate", 1, "input split then summed by HF: kept whole (exact; memory not divided)"),
    "embedding_colwise": ("replicate", 1, "hidden-split embedding gathered by HF: kept whole (exact)"),
    # MoE: dsforge splits experts over the expert-parallel group (whole experts), the same routed sum.
    "moe_tp_experts": ("expert", 1, "experts split over the expert-parallel group"),
    "ep_dispatch_experts": ("expert", 1, "experts split over the expert-parallel group"),
    "grouped_gemm": ("expert", 1, "stacked expert weights: whole experts per EP rank"),
    "moe_identity_expert": ("an identity expert (zero-compute expert) has no dsforge expert variant: the "
                            "expert layer's all-to-all would drop or double the tokens routed to it"),
}
#: Styles that hand their placement to the module's children or owner (no row of their own).
_STRUCTURAL = {
    "all_reduce": "its children's rowwise rows already sum the partial outputs",
    "local_params": "the owning attention is kept whole, since dsforge splits modules, not bare parameters",
    "mla_kv_a_proj": "MLA: the attention is kept whole (the rotary "
                     "key shared by every head has no per-rank split)",
}

#: Last name component of a projection -> its head kind (column: the split falls on whole heads).
_HEAD_NAMES: dict[str, HeadKind] = {
    "q_proj": "q", "query": "q", "q": "q", "q_b_proj": "q", "wq": "q",
    "k_proj": "kv", "v_proj": "kv", "key": "kv", "value": "kv", "k": "kv", "v": "kv", "wk": "kv", "wv": "kv",
    "kv_b_proj": "q",  # MLA: per query head (its attention is kept whole anyway)
    "query_key_value": "qkv",
}
_ROW_HEAD_NAMES = ("o_proj", "out_proj", "dense", "wo", "c_proj")
_ATTENTION = re.compile(r"(?:^|\.)(?:self_attn|attn|attention|self_attention)(?:\.|$)")


#: Families whose hand-written policy stays: model_type -> (arch, the modules it places otherwise than the HF
#: plan, each as a plan path). The HF plan is exact there too (replicated), but divides less memory.
KEEP_HANDWRITTEN: dict[str, tuple[str, tuple[str, ...], str]] = {
    "phi3": (
        "phi3",
        (
            "model.layers.*.mlp.down_proj.weight",
            "model.layers.*.mlp.gate_up_proj.weight",
            "model.layers.*.self_attn.o_proj.weight",
            "model.layers.*.self_attn.qkv_proj.weight",
        ),
        (
            "HF gathers qkv_proj and gate_up_proj (colwise_gather_output) and replicates o_proj and "
            "down_proj (rowwise_split_input); dsforge splits "
            "the fused blocks of unequal size by their own heads"
        ),
    ),
    "olmo2": (
        "olmo2",
        tuple(
            f"model.layers.*.self_attn.{m}.weight"
            for m in ("k_norm", "k_proj", "o_proj", "q_norm", "q_proj", "v_proj")
        ),
        (
            "HF gathers q/k/v (its q_norm/k_norm normalise the whole projection); dsforge splits them by "
            "heads and all-reduces the norms' mean square (shard_norm)"
        ),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        tuple(f"model.layers.*.mlp.shared_expert.{m}.weight" for m in ("down_proj", "gate_proj", "up_proj")),
        "HF's plan omits the shared expert (replicated); dsforge splits it as a dense MLP",
    ),
}


@dataclass(frozen=True)
class HfPlans:
    """One model type's plans: base tp/pp/ep plans of its config, the causal-LM class's head plans."""

    model_type: str
    tp: Mapping[str, str] = field(default_factory=dict)
    pp: Mapping[str, Any] = field(default_factory=dict)
    ep: Mapping[str, str] = field(default_factory=dict)
    head_tp: Mapping[str, str] = field(default_factory=dict)
    head_pp: Mapping[str, Any] = field(default_factory=dict)
    tied: tuple[str, ...] = ()
    causal_lm: str = ""


@dataclass(frozen=True)
class PlanRefusal(Exception):
    """A plan dsforge cannot place exactly: ``rule``, and the message naming module, style and why."""

    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


@dataclass(frozen=True)
class DerivedPolicy:
    """A policy derived from HF plans, with the plan entries it folded into others and the unchecked
    columns."""

    policy: Policy
    folded: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()


def known_types() -> list[str]:
    """The causal-LM model types of the generated table."""
    return sorted(PLANS)


def plans_for_type(model_type: str) -> HfPlans | None:
    """The plans of ``model_type`` from the table generated from transformers (None: not a causal LM
    there)."""
    row = PLANS.get(model_type)
    if row is None:
        return None
    return HfPlans(model_type, tp=dict(row.get("tp") or {}), pp=dict(row.get("pp") or {}),
                   ep=dict(row.get("ep") or {}), head_tp=dict(row.get("head_tp") or {}),
                   head_pp=dict(row.get("head_pp") or {}), tied=tuple(row.get("tied") or ()),
                   causal_lm=str(row.get("causal_lm") or ""))


def plans_from_classes(model_type: str, config_cls: Any, lm_cls: Any | None) -> HfPlans:
    """The plans read from a configuration class and a model class (the runtime's path; no torch here)."""
    def get(obj: Any, name: str) -> dict[str, Any]:
        return dict(getattr(obj, name, None) or {}) if obj is not None else {}
    return HfPlans(model_type, tp=get(config_cls, "base_model_tp_plan"),
                   pp=get(config_cls, "base_model_pp_plan"), ep=get(config_cls, "base_model_ep_plan"),
                   head_tp=get(lm_cls, "_tp_plan"), head_pp=get(lm_cls, "_pp_plan"),
                   tied=tuple(sorted(getattr(lm_cls, "_tied_weights_keys", None) or ())),
                   causal_lm=getattr(lm_cls, "__name__", ""))


def pp_plan_problem_of(plans: HfPlans) -> str | None:
    """Why a model_type's classes state no pipeline plan of the shape the derived stages build (None when
    they do)."""
    if not plans.pp:
        return (f"transformers {TRANSFORMERS_VERSION} states no base_model_pp_plan for "
                f"`{plans.model_type}`, so its stages (embedding, layers, final norm, head) are not known")
    if tuple(sorted(plans.pp)) != tuple(sorted(PP_PLAN_KEYS)):
        return (f"the base_model_pp_plan of `{plans.model_type}` has the pieces {sorted(plans.pp)}; the "
                f"derived stages are built for {list(PP_PLAN_KEYS)} only")
    return None


def table_version() -> str:
    """The transformers version the table was generated from."""
    return TRANSFORMERS_VERSION


def path_regex(path: str) -> str:
    """A plan path (``layers.*.mlp.up_proj``) as a policy regex: ``*`` one layer index, any wrapper prefix."""
    return _P + r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in path.split("."))


def _head_kind(path: str, variant: Variant) -> HeadKind | None:
    if not _ATTENTION.search(path):
        return None
    last = path.rsplit(".", 1)[-1]
    if variant == "column":
        return _HEAD_NAMES.get(last)
    if variant == "row" and last in _ROW_HEAD_NAMES:
        return "q"
    return None


def _under(path: str, parents: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in parents)


def derive_policy(plans: HfPlans, arch: str | None = None) -> DerivedPolicy:
    """The rewrite policy HF's plans state, in dsforge's variants; PlanRefusal when a style has no exact
    one."""
    if not plans.tp and not plans.ep:
        raise PlanRefusal(NO_PLAN, f"model_type {plans.model_type!r} has no tensor- or expert-parallel plan "
                          f"in transformers {TRANSFORMERS_VERSION}, and "
                          f"dsforge has no hand-written policy for it",
                          "run it at tp=1 and ep=1, or give `rewrite:` rules with model.arch: custom")
    merged: dict[str, str] = {}
    for source in (plans.ep, plans.tp):  # tp second: a module both plans name takes its tp style's row order
        merged.update(source)
    # Owners kept whole: attention holding MLA's shared rotary key or bare per-head parameters (sinks).
    whole = sorted({p.rsplit(".", 1)[0] if s == "mla_kv_a_proj" else p for p, s in merged.items()
                    if s in ("mla_kv_a_proj", "local_params")})
    experts = sorted(
        p
        for p, s in merged.items()
        if STYLES.get(s, ("",))[0] == "expert"
        and not any(
            q != p and p.startswith(q + ".") and STYLES.get(merged[q], ("",))[0] == "expert" for q in merged
        )
    )
    rows: list[PolicyRow] = []
    folded: list[str] = []
    unchecked: list[str] = []
    for p in whole:
        rows.append(
            PolicyRow(
                path_regex(p),
                "replicate",
                why=f"HF plan: {_STRUCTURAL['mla_kv_a_proj']}"
                if any(merged.get(q) == "mla_kv_a_proj" for q in merged if q.startswith(p + "."))
                else f"HF plan: {_STRUCTURAL['local_params']}",
            )
        )
    # Longest paths first within the same owner, so an expert module claims its subtree before its rows.
    for path in sorted(merged, key=lambda q: (q.count("."), q)):
        style = merged[path]
        refused = STYLES.get(style)
        if isinstance(refused, str):  # refused wherever it sits: an owner kept whole or split still runs it
            raise PlanRefusal(STYLE_REFUSED, f"model_type {plans.model_type!r}: {path} has the HF parallel "
                              f"style {style!r}: {refused}",
                              "run it at tp=1 and ep=1, or replace that module")
        if _under(path, whole):
            folded.append(f"{path}: {style} (inside "
                          f"{next(w for w in whole if _under(path, [w]))}, kept whole)")
            continue
        if any(path != e and path.startswith(e + ".") for e in experts):
            folded.append(f"{path}: {style} (inside the expert module)")
            continue
        if style in _STRUCTURAL:
            folded.append(f"{path}: {style} ({_STRUCTURAL[style]})")
            continue
        mapped = STYLES.get(style)
        if mapped is None:
            raise PlanRefusal(STYLE_REFUSED, f"model_type {plans.model_type!r}: {path} has the HF parallel "
                              f"style {style!r}, which dsforge does not know",
                              "use model.arch: custom with `rewrite:` rules")
        assert not isinstance(mapped, str)  # refused above
        variant, fused, why = mapped
        heads = _head_kind(path, variant)
        if variant == "column" and heads is None and _ATTENTION.search(path):
            unchecked.append(path)
        rows.append(PolicyRow(path_regex(path), variant, fused=fused, heads=heads, why=f"HF {style}: {why}"))
    for path, style in plans.ep.items():  # an ep entry the tp plan also names is placed by the tp row above
        if plans.tp.get(path, style) != style:
            folded.append(f"{path}: {style} (the tp plan's {plans.tp[path]} row places it)")
    rows += _defaults(plans, merged)
    layers = next((k for k, v in plans.pp.items() if isinstance(v, (list, tuple)) and "hidden_states" in v[0]
                   and k not in _final_norms(plans)), None) or "layers"
    name = arch or f"hf:{plans.model_type}"
    policy = Policy(arch=name, rows=tuple(rows), layers=_P + re.escape(layers) + r"\.(\d+)", signature=())
    return DerivedPolicy(policy, tuple(folded), tuple(unchecked))


def _final_norms(plans: HfPlans) -> list[str]:
    """pp-plan stages that are not the layer list, the embedding or the head: the final norm(s)."""
    items = list(plans.pp.items())
    return [k for i, (k, v) in enumerate(items) if i > 0 and i == len(items) - 1 and "norm" in k]


def _defaults(plans: HfPlans, merged: Mapping[str, str]) -> list[PolicyRow]:
    """The rows for what HF leaves unlisted: the embedding (vocab), norms (norm), the LM head (vocab)."""
    rows: list[PolicyRow] = []
    stages = list(plans.pp)
    embed = stages[0] if stages and "input_ids" in (plans.pp[stages[0]][0] or ()) else None
    if embed is not None and embed not in merged:
        rows.append(PolicyRow(path_regex(embed), "vocab",
                              why="token embedding (HF: replicated): vocab-parallel, the same lookup summed"))
    rows.append(PolicyRow(_P + r"(?:\w*norm\w*|ln(?:_\w+)?)", "norm",
                          why="norm (HF: replicated): replicated; summed "
                              "over TP only under sequence parallelism"))
    for head, style in plans.head_tp.items():
        if style in ("colwise_gather_output", "colwise", "colwise_rep"):
            rows.append(PolicyRow(re.escape(head), "vocab",
                                  why=f"HF {style}: LM head split over the vocabulary (vocab-parallel loss)"))
        else:
            rows.append(PolicyRow(re.escape(head), "replicate", why=f"HF {style}: kept whole (exact)"))
    return rows


def complete_rows(policy: Policy, leftover: Sequence[str]) -> Policy:
    """The policy with a ``replicate`` row for each parameter owner no row placed (HF replicates them too)."""
    extra = tuple(PolicyRow(re.escape(name), "replicate", why="not in the HF plan: replicated, as HF does")
                  for name in leftover)
    return Policy(arch=policy.arch, rows=policy.rows + extra, layers=policy.layers,
                  signature=policy.signature, attr_scales=policy.attr_scales, absent=policy.absent,
                  sequence_parallel=policy.sequence_parallel)


def placements(plans: HfPlans) -> list[tuple[str, str, str]]:
    """(plan path, HF style, dsforge placement or `refused: why`) for every entry of the plans."""
    out = []
    for source in (plans.tp, plans.ep, plans.head_tp):
        for path, style in source.items():
            mapped = STYLES.get(style)
            if isinstance(mapped, tuple):
                out.append((path, style, mapped[0] + (f" fused={mapped[1]}" if mapped[1] > 1 else "")))
            elif style in _STRUCTURAL:
                out.append((path, style, f"folded: {_STRUCTURAL[style]}"))
            else:
                out.append((path, style, f"refused: {mapped or 'unknown style'}"))
    return out
