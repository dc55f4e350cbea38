"""The families' rewrite plans on the meta device: detection, exact counts, and every refusal names its
module.

No processes: the plans are shape arithmetic over a model built on ``meta`` (what `dsforge compile`
records in plan.json). The parity of the plans against the dense models is test_family_parity.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dsforge.compiler.model.params import total_params
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import describe, plan_rewrite
from dsforge.runtime.rewrite.detect import detect_arch
from dsforge.runtime.rewrite.planner import RewriteError
from tests.runtime_rewrite.families import FAMILY_JOBS


@pytest.mark.parametrize("family", sorted(FAMILY_JOBS))
def test_auto_detects_each_family_and_the_formula_counts_it(job, family):
    model = FAMILY_JOBS[family]
    _, plan = job(model, {"tp": 2})
    built = build_model(plan.model, "meta")
    found, reasons = detect_arch(built)
    assert found == model["arch"], reasons
    rp = plan_rewrite(built, plan)
    assert rp.total_params == sum(p.numel() for p in built.parameters())
    if family not in ("qwen2", "deepseek_v3"):  # arch llama counts no q/k/v biases; MLA has no formula
        assert total_params(plan.model) == rp.total_params


def test_per_head_and_whole_projection_norms_are_planned_as_such(job):
    spec, plan = job(FAMILY_JOBS["qwen3"], {"tp": 2})
    q_norm = plan_rewrite(spec.model, plan).module("model.layers.0.self_attn.q_norm")
    assert q_norm.variant == "head_norm" and q_norm.params[0].shard == (16,)
    assert "gradient summed over the tp=2 ranks" in q_norm.notes[0]
    spec, plan = job(FAMILY_JOBS["olmo2"], {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.module("model.layers.0.self_attn.q_norm").params[0].shard == (32,)  # 2 of 4 query heads
    assert rp.module("model.layers.0.self_attn.k_norm").params[0].shard == (16,)  # 1 of 2 key heads


def test_heads_wider_than_hidden_over_heads_are_split_by_the_models_head_dim(job):
    wide = {**FAMILY_JOBS["gemma2"], "factory": "tests.runtime_rewrite.families:gemma2_wide_heads"}
    spec, plan = job(wide, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    assert rp.head_dim == 32  # the model's, not hidden / heads = 16
    assert rp.module("model.layers.0.self_attn.q_proj").params[0].shard == (64, 64)  # 2 of 4 heads x 32
    assert rp.module("model.layers.0.self_attn.o_proj").params[0].shard == (64, 64)


def test_unequal_fused_blocks_split_by_their_real_sizes(job):
    spec, plan = job(FAMILY_JOBS["phi3"], {"tp": 2})
    qkv = plan_rewrite(spec.model, plan).module("model.layers.0.self_attn.qkv_proj")
    assert qkv.widths == (64, 32, 32) and qkv.params[0].shard == (64, 64)  # 32 + 16 + 16 rows
    spec, plan = job(FAMILY_JOBS["gpt_neox"], {"tp": 2})
    fused = plan_rewrite(spec.model, plan).module("gpt_neox.layers.0.attention.query_key_value")
    assert fused.heads == "qkv" and fused.params[0].shard == (96, 64)  # 2 heads x [q k v] x 16


def test_a_norm_placed_as_the_wrong_kind_is_refused_naming_it(job):
    # OLMo2's whole-projection norm as a per-head one
    olmo_as_qwen3 = {**FAMILY_JOBS["olmo2"], "arch": "qwen3"}
    spec, plan = job(olmo_as_qwen3, {"tp": 2})
    with pytest.raises(RewriteError, match=r"self_attn\.q_norm .*`head_norm` is "
                                           r"a norm over one head's 16 channels"):
        plan_rewrite(spec.model, plan)


def test_moe_top_k_and_shared_experts_are_checked_against_the_model(job):
    top8 = FAMILY_JOBS["qwen3_moe"]
    spec, plan = job(top8, {"tp": 2})
    built = build_model(plan.model, "meta")  # a top-8 model
    _, plan2 = job({**top8, "moe": {**top8["moe"], "top_k": 2}}, {"tp": 2})
    with pytest.raises(RewriteError,
                       match=r"routes each token to top-8 experts but the job says moe.top_k=2"):
        plan_rewrite(built, plan2)
    spec, plan = job(FAMILY_JOBS["qwen2_moe"], {"dp": 2, "ep": 2})
    built = build_model(plan.model, "meta")
    moe = FAMILY_JOBS["qwen2_moe"]["moe"]
    _, plan2 = job({**FAMILY_JOBS["qwen2_moe"], "moe": {**moe, "shared_ffn_hidden": 24}}, {"dp": 2, "ep": 2})
    with pytest.raises(RewriteError, match=r"shared expert is 48 wide, the job's .* = 1 x 24"):
        plan_rewrite(built, plan2)
    assert describe(spec, plan)["params"]["total"] == total_params(plan.model)


def test_layouts_the_runtime_cannot_run_exactly_are_refused_at_plan_time(job):
    spec, plan = job(FAMILY_JOBS["qwen3"], {"tp": 2, "sequence_parallel": True})
    with pytest.raises(RewriteError, match="sequence parallelism is implemented for the families"):
        plan_rewrite(spec.model, plan)
    spec, plan = job(FAMILY_JOBS["deepseek_v3"], {"dp": 2, "ep": 2})
    with pytest.raises(RewriteError, match="DeepseekV3TopkRouter is not a softmax top-k router"):
        plan_rewrite(spec.model, plan)
    one = {**FAMILY_JOBS["mixtral"], "moe": {**FAMILY_JOBS["mixtral"]["moe"], "top_k": 1}}
    spec, plan = job(one, {"dp": 2, "ep": 2})
    with pytest.raises(RewriteError, match="top-1 routing renormalised to weight 1 has no DeepSpeed twin"):
        plan_rewrite(spec.model, plan)


def test_a_router_copied_from_a_softmax_router_is_one_and_any_other_is_not():
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    import benchmarks.hf_zoo as zoo
    from dsforge.runtime.rewrite.planner import softmax_router

    cfg = zoo.tiny_config("olmoe")
    assert softmax_router(OlmoeTopKRouter(cfg))  # its forward is Qwen3-MoE's, copied
    assert not softmax_router(DeepseekV3TopkRouter(zoo.tiny_config("deepseek_v3")))  # sigmoid, groups

    class Tempered(Qwen3MoeTopKRouter):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states / 2)

    assert not softmax_router(Tempered(zoo.tiny_config("qwen3_moe")))


def test_an_moe_block_the_applier_cannot_replace_is_refused_at_plan_time(job):
    """GraniteMoE keeps its router as `router`: under ep > 1 compile refuses it (the applier used to, once the
    run had started)."""
    import benchmarks.hf_zoo as zoo

    model = zoo._factory("granitemoe")()
    keys = zoo._job_keys(model, "granitemoe")
    _, plan = job(keys, {"dp": 2, "ep": 2})
    with pytest.raises(RewriteError, match=r"block_sparse_moe.experts .*GraniteMoeMoE has no `gate`: use ep"):
        plan_rewrite(model, plan)
    _, plan = job(keys, {"tp": 2})
    plan_rewrite(model, plan)  # at ep 1 its experts stay whole: placed


def test_context_parallel_attention_refuses_what_it_would_drop():
    """Ring/Ulysses attention is plain causal attention: soft-capping or a shorter sliding window is
    refused."""
    import torch
    from torch import nn

    from dsforge.runtime import hf_attention

    module = nn.Module()
    setattr(module, hf_attention._ATTR, lambda q, k, v, scale: q.transpose(1, 2))
    setattr(module, hf_attention._SIZE, 2)
    q = torch.zeros(1, 2, 8, 4)  # 8 local tokens of 16
    with pytest.raises(hf_attention.ContextParallelError, match="soft-caps its attention scores"):
        hf_attention._attention(module, q, q, q, None, softcap=50.0)
    with pytest.raises(hf_attention.ContextParallelError,
                       match="sliding window of 8 tokens, shorter than the "
                                                                "sequence of 16"):
        hf_attention._attention(module, q, q, q, None, sliding_window=8)
    out, _ = hf_attention._attention(module, q, q, q, None, sliding_window=16, softcap=None)
    assert out.shape == (1, 8, 2, 4)
