"""Derived policies (from HF's own tp/ep plans) against the hand-written ones, parameter by parameter, on
meta.

For every family that has both, the policy transformers' plans give must place each parameter as
the hand-written policy does (variant, fused blocks, head kind) — or the family is one of
``KEEP_HANDWRITTEN``, whose HF plan gathers or omits what the hand-written policy splits, and then the
test requires the difference to be exactly the modules that list names (so the list stays true).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from dsforge.compiler.model.hf_plans import KEEP_HANDWRITTEN, complete_rows, derive_policy, plans_for_type
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.model.rewrite_policies import POLICIES, PolicyRow
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import plan_rewrite
from dsforge.runtime.rewrite.derived import derived_arch, hf_plans_of
from dsforge.runtime.rewrite.walk import match_rows
from tests.runtime_rewrite.families import FAMILY_JOBS


def _placement(row: PolicyRow) -> tuple[object, ...]:
    # norm and replicate both keep the parameter whole on every rank; they differ only in the gradient sum
    # sequence parallelism adds, which derived policies refuse (sequence_parallel False): the same placement.
    variant = "replicate" if row.variant == "norm" else row.variant
    return (variant, row.fused, row.heads, row.blocks)


def _per_param(model, rows):
    walk = match_rows(model, [(f"r{i}", r) for i, r in enumerate(rows)])
    out = {}
    for claim in walk.claims:
        for name, _ in claim.module.named_parameters():
            out[f"{claim.name}.{name}" if claim.name else name] = _placement(claim.row)
    return out, walk.leftover


@pytest.mark.parametrize("family", sorted(FAMILY_JOBS))
def test_the_derived_policy_places_every_parameter_as_the_hand_written_one(job, family):
    keys = FAMILY_JOBS[family]
    spec, _ = job(keys)
    model = build_model(resolve_model(spec.model), "meta")
    mtype = model.config.model_type
    derived = derive_policy(plans_for_type(mtype))
    _, leftover = _per_param(model, derived.policy.rows)
    policy = complete_rows(derived.policy, leftover)
    got, left = _per_param(model, policy.rows)
    hand = POLICIES[keys["arch"]]
    want, hand_left = _per_param(model, hand.rows)
    assert not derived.policy.sequence_parallel
    assert left == [] and hand_left == []
    assert set(got) == set(want) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    differ = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in want if got[n] != want[n]})
    if mtype in KEEP_HANDWRITTEN:
        assert differ == sorted(KEEP_HANDWRITTEN[mtype][1]), differ
    else:
        assert differ == [], {n: (want[n], got[n]) for n in want if got[n] != want[n]}


def test_plans_from_the_classes_match_the_generated_table(job):
    spec, _ = job(FAMILY_JOBS["qwen3_moe"])
    model = build_model(resolve_model(spec.model), "meta")
    from_classes, from_table = hf_plans_of(model), plans_for_type("qwen3_moe")
    assert (from_classes.tp, from_classes.ep,
            from_classes.head_tp) == (from_table.tp, from_table.ep, from_table.head_tp)


def _starcoder2(m):
    from transformers import Starcoder2Config

    from tests.runtime_rewrite.families import _build, _common
    return _build(Starcoder2Config(**_common(m), residual_dropout=0.0, embedding_dropout=0.0))


def test_a_family_without_a_hand_written_policy_is_planned_by_its_own_plan(job, monkeypatch):
    import tests.runtime_rewrite.families as fam

    monkeypatch.setattr(fam, "starcoder2", _starcoder2, raising=False)
    keys = {**FAMILY_JOBS["qwen3"], "arch": "auto", "factory": "tests.runtime_rewrite.families:starcoder2"}
    spec, plan = job(keys, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.arch == "hf:starcoder2"
    assert rp.module("model.layers.0.self_attn.k_proj").variant == "column"
    assert rp.module("model.layers.0.self_attn.k_proj").params[0].shard == (16, 64)  # one of the 2 kv heads
    assert rp.module("model.layers.0.mlp.c_fc").variant == "column"
    assert rp.module("model.layers.0.mlp.c_proj").variant == "row"
    assert rp.module("model.embed_tokens").variant == "vocab"
    model = build_model(resolve_model(spec.model), "meta")
    assert rp.total_params == sum(p.numel() for p in model.parameters())
    assert derived_arch(model) == "hf:starcoder2"


def _apertus(m):
    from transformers import ApertusConfig

    from tests.runtime_rewrite.families import _build, _common
    return _build(ApertusConfig(**_common(m)))


def test_learnt_scalars_between_two_splits_sum_their_gradient_and_more_is_refused(job, monkeypatch):
    """Apertus' xIELU (alpha_p, alpha_n) between up_proj and down_proj is placed as `scalars` (its gradient
    summed over TP; the zoo measured 0.42 of the scale off without the sum); an owner of anything wider
    there is refused with DSF172, naming it and its split neighbour."""
    import torch
    from torch import nn

    import tests.runtime_rewrite.families as fam
    from dsforge.compiler.model.hf_plans import SPLIT_NEIGHBOUR, PlanRefusal

    monkeypatch.setattr(fam, "apertus", _apertus, raising=False)
    spec, plan = job({**FAMILY_JOBS["qwen3"], "arch": "auto",
                      "factory": "tests.runtime_rewrite.families:apertus"}, {"tp": 2})
    model = build_model(resolve_model(spec.model), "meta")
    rows = {r.match: r.variant for r in POLICIES[derived_arch(model)].rows}
    assert rows[r"model\.layers\.0\.mlp\.act_fn"] == "scalars"
    act = plan_rewrite(model, plan).module("model.layers.0.mlp.act_fn")
    assert act.variant == "scalars" and any("gradient summed over the tp=2 ranks" in n for n in act.notes)
    model.model.layers[0].mlp.act_fn.scale = nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(PlanRefusal) as exc:
        derived_arch(model)
    assert exc.value.rule == SPLIT_NEIGHBOUR
    assert (
        "model.layers.0.mlp.act_fn" in exc.value.message and "model.layers.0.mlp.up_proj" in exc.value.message
    )


def _sarvam_moe(m):
    from transformers import SarvamMoEConfig

    from tests.runtime_rewrite.families import _build, _common
    moe = m.moe
    return _build(SarvamMoEConfig(**_common(m, head_dim=m.hidden // m.heads), n_routed_experts=moe.experts,
                                  num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ffn_hidden,
                                  n_shared_experts=moe.shared_experts, use_qk_norm=True,
                                  first_k_dense_replace=0))


def test_per_head_qk_norms_the_plan_leaves_plain_norms_get_their_gradient_summed(job, monkeypatch):
    # Sarvam-MoE's plan splits q/k/v by heads and says nothing of q_norm/k_norm: replicated plain norms
    # would keep half the gradient on each rank (the zoo measured 1.06 of the reference's scale).
    import tests.runtime_rewrite.families as fam

    monkeypatch.setattr(fam, "sarvam_moe", _sarvam_moe, raising=False)
    keys = {**FAMILY_JOBS["deepseek_v3"], "arch": "auto",
            "factory": "tests.runtime_rewrite.families:sarvam_moe"}
    spec, plan = job(keys, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.arch == "hf:sarvam_moe"
    for layer in (0, 1):
        for norm in ("q_norm", "k_norm"):
            assert rp.module(f"model.layers.{layer}.self_attn.{norm}").variant == "head_norm"
    # a norm outside attention stays plain
    assert rp.module("model.layers.0.input_layernorm").variant == "norm"


def test_a_derived_policy_at_pp2_plans_when_its_stages_reproduce_the_forward(job, monkeypatch):
    # starcoder2's pp plan is embed_tokens / layers / norm and its forward has no glue the stages miss, so the
    # rewrite plans at pp=2 (it was refused before the stages were cut; refusals: test_derived_pipeline.py)
    import tests.runtime_rewrite.families as fam

    monkeypatch.setattr(fam, "starcoder2", _starcoder2, raising=False)
    keys = {**FAMILY_JOBS["qwen3"], "arch": "auto", "factory": "tests.runtime_rewrite.families:starcoder2"}
    spec, plan = job(keys, {"tp": 1, "pp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.arch == "hf:starcoder2" and rp.pp == 2 and {m.stage for m in rp.modules} == {0, 1}


def test_a_derived_policy_refuses_tp_above_the_kv_heads_naming_each_projection(job, monkeypatch):
    # the HF plan says only "colwise"; whole KV heads per rank is dsforge's check (DSF104's condition)
    import tests.runtime_rewrite.families as fam
    from dsforge.runtime.rewrite.planner import RewriteError

    monkeypatch.setattr(fam, "starcoder2", _starcoder2, raising=False)
    keys = {**FAMILY_JOBS["qwen3"], "arch": "auto", "factory": "tests.runtime_rewrite.families:starcoder2"}
    spec, plan = job(keys, {"tp": 4})
    with pytest.raises(RewriteError) as exc:
        plan_rewrite(spec.model, plan)
    text = "\n".join(exc.value.problems)
    for proj in ("k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj} (hf:starcoder2" in text
    assert "tp=4 does not divide its 2 key/value heads" in text


def _nanochat(m):
    from transformers import NanoChatConfig

    from tests.runtime_rewrite.families import _build, _common
    return _build(NanoChatConfig(**_common(m, head_dim=m.hidden // m.heads)))


def test_a_weightless_qk_norm_stays_a_plain_norm(job, monkeypatch):
    # NanoChat's q/k norms hold no weight: nothing to sum over TP, so no head_norm row (which would refuse it)
    import tests.runtime_rewrite.families as fam

    monkeypatch.setattr(fam, "nanochat", _nanochat, raising=False)
    keys = {**FAMILY_JOBS["qwen3"], "arch": "auto", "factory": "tests.runtime_rewrite.families:nanochat"}
    spec, plan = job(keys, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.arch == "hf:nanochat"
    assert rp.module("model.layers.0.self_attn.q_norm").variant != "head_norm"
