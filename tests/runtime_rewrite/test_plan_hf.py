"""The rewrite plan of the HF gpt2 / llama / mixtral families: coverage, shard shapes, counts, stages,
errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from torch import nn

from dsforge.compiler.model.params import embedding_params, head_params, layer_params, total_params
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import RewriteError, describe, plan_rewrite

TINY = {"gpt2": "tiny-gpt2", "llama": "tiny-llama", "mixtral": "tiny-mixtral"}


def _shapes(rp, name):
    return {p.name: (p.shape, p.shard, p.dim) for p in rp.module(name).params}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_every_parameter_is_placed_exactly_once(job, arch):
    spec, plan = job({"preset": TINY[arch]}, {"tp": 2})
    model = build_model(spec.model, "meta", 2)
    rp = plan_rewrite(model, plan)
    placed = [f"{m.name}.{p.name}" for m in rp.modules for p in m.params]
    assert sorted(placed) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert rp.arch == arch
    assert rp.total_params == total_params(spec.model, 2) == sum(p.numel() for p in model.parameters())


def test_gpt2_conv1d_shards_follow_the_transposed_weight(job):
    spec, plan = job({"preset": "tiny-gpt2"}, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    # Conv1D stores weight as (in, out): column cuts dim 1, row cuts dim 0; a row bias stays whole.
    assert _shapes(rp, "transformer.h.0.attn.c_attn") == {
        "weight": ((64, 192), (64, 96), 1), "bias": ((192,), (96,), 0)}
    assert _shapes(rp, "transformer.h.1.attn.c_proj") == {
        "weight": ((64, 64), (32, 64), 0), "bias": ((64,), (64,), None)}
    assert _shapes(rp, "transformer.h.0.mlp.c_fc")["weight"] == ((64, 256), (64, 128), 1)
    assert _shapes(rp, "transformer.h.0.mlp.c_proj")["weight"] == ((256, 64), (128, 64), 0)
    assert _shapes(rp, "transformer.wte")["weight"] == ((256, 64), (128, 64), 0)
    assert _shapes(rp, "transformer.wpe")["weight"] == ((64, 64), (64, 64), None)
    assert rp.module("lm_head").tied_to == "transformer.wte"
    assert rp.module("lm_head").variant == "vocab"


def test_gpt2_per_rank_count_from_first_principles(job):
    spec, plan = job({"preset": "tiny-gpt2"}, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    h, f, v, s, tp = 64, 256, 256, 64, 2
    layer = ((h * 3 * h + 3 * h) // tp + h * h // tp + h + (h * f + f) // tp + f * h // tp + h + 4 * h)
    assert rp.stage_params() == [v * h // tp + s * h + 2 * layer + 2 * h]
    assert rp.attr_scales == [(f"transformer.h.{i}.attn",
                               a) for i in range(2) for a in ("split_size", "num_heads")]


def test_llama_gqa_shards_and_per_rank_count(job):
    spec, plan = job({"preset": "tiny-llama"}, {"tp": 2})
    rp = plan_rewrite(spec.model, plan)
    attn = "model.layers.3.self_attn"
    assert _shapes(rp, f"{attn}.q_proj") == {"weight": ((64, 64), (32, 64), 0)}
    assert _shapes(rp, f"{attn}.k_proj") == {"weight": ((32, 64), (16, 64), 0)}
    assert _shapes(rp, f"{attn}.v_proj") == {"weight": ((32, 64), (16, 64), 0)}
    assert _shapes(rp, f"{attn}.o_proj") == {"weight": ((64, 64), (64, 32), 1)}
    assert _shapes(rp, "model.layers.0.mlp.down_proj") == {"weight": ((64, 128), (64, 64), 1)}
    assert _shapes(rp, "lm_head") == {"weight": ((256, 64), (128, 64), 0)}
    norms = (2 * 4 + 1) * 64  # RMSNorm weights are the only replicated parameters
    assert rp.stage_params() == [(rp.total_params - norms) // 2 + norms]


def test_mixtral_experts_split_over_ep_and_kept_whole_over_tp(job):
    spec, plan = job({"preset": "tiny-mixtral"}, {"tp": 2, "dp": 2, "ep": 2})
    rp = plan_rewrite(spec.model, plan)
    experts = rp.module("model.layers.1.mlp.experts")
    assert experts.variant == "expert"
    assert _shapes(rp, "model.layers.1.mlp.experts") == {
        "gate_up_proj": ((4, 256, 64), (2, 256, 64), 0), "down_proj": ((4, 64, 128), (2, 64, 128), 0)}
    assert any("tp=2" in n for n in experts.notes)
    assert rp.module("model.layers.0.mlp.gate").variant == "replicate"
    assert rp.total_params == total_params(spec.model)


def test_pipeline_stages_follow_the_plan_partition(job):
    spec, plan = job({"preset": "tiny-llama"}, {"pp": 2, "pipeline": {"partition": [1, 3]}})
    rp = plan_rewrite(spec.model, plan)
    assert {m.layer: m.stage for m in rp.modules if m.layer is not None} == {0: 0, 1: 1, 2: 1, 3: 1}
    assert rp.module("model.embed_tokens").stage == 0
    assert rp.module("model.norm").stage == rp.module("lm_head").stage == 1
    m = plan.model
    assert rp.stage_params() == [embedding_params(m) + layer_params(m).total,
                                 3 * layer_params(m).total + head_params(m)]


def test_tied_embedding_is_held_by_both_end_stages_but_counted_once(job):
    spec, plan = job({"preset": "tiny-gpt2"}, {"pp": 2})
    rp = plan_rewrite(spec.model, plan)
    wte = 256 * 64
    assert rp.total_params == total_params(spec.model)
    assert sum(rp.stage_params()) == rp.total_params + wte


def test_kv_heads_that_tp_cannot_split_are_named(job):
    spec, plan = job({"preset": "tiny-llama"}, {"tp": 4})
    with pytest.raises(RewriteError) as err:
        plan_rewrite(spec.model, plan)
    text = str(err.value)
    assert "model.layers.0.self_attn.k_proj" in text and "model.layers.3.self_attn.v_proj" in text
    assert "tp=4 does not divide its 2 key/value heads" in text and "replicate_kv_heads" in text
    assert "q_proj" not in text  # 4 query heads split fine over 4 ranks


def test_replicated_kv_heads_give_each_rank_one_head(job):
    spec, plan = job({"preset": "tiny-llama"}, {"tp": 4, "replicate_kv_heads": True})
    rp = plan_rewrite(spec.model, plan)
    assert _shapes(rp, "model.layers.0.self_attn.k_proj") == {"weight": ((32, 64), (16, 64), 0)}
    assert _shapes(rp, "model.layers.0.self_attn.q_proj") == {"weight": ((64, 64), (16, 64), 0)}
    assert any("replicated 2x" in n for n in rp.module("model.layers.0.self_attn.k_proj").notes)


def test_vocabulary_that_does_not_split_suggests_padding(job):
    spec, plan = job({"preset": "tiny-llama", "vocab": 255}, {"tp": 2})
    with pytest.raises(RewriteError, match="vocab_multiple_of") as err:
        plan_rewrite(spec.model, plan)
    assert "model.embed_tokens" in str(err.value) and "lm_head" in str(err.value)
    spec, plan = job({"preset": "tiny-llama", "vocab": 255, "vocab_multiple_of": 64}, {"tp": 2})
    assert plan_rewrite(spec.model, plan).module("lm_head").params[0].shard == (128, 64)


def test_modules_no_rule_places_are_named(job):
    spec, plan = job({"preset": "tiny-llama"}, {"tp": 2})
    model = build_model(spec.model, "meta", 2)
    model.model.extra = nn.Linear(4, 4, device="meta")
    for layer in model.model.layers:
        layer.mlp.scale = nn.Linear(4, 4, device="meta")
    with pytest.raises(RewriteError) as err:
        plan_rewrite(model, plan)
    assert err.value.leftover == ["model.layers.0.mlp.scale", "model.layers.1.mlp.scale",
                                  "model.layers.2.mlp.scale", "model.layers.3.mlp.scale", "model.extra"]
    assert "model.layers.{0..3}.mlp.scale, model.extra" in str(err.value)


def test_describe_is_json_and_reports_failures_as_data(job):
    spec, plan = job({"preset": "tiny-mixtral"}, {"tp": 2})
    out = describe(spec, plan)
    assert out["ok"] and out["params"]["total"] == out["params"]["formula_total"] == total_params(spec.model)
    json.dumps(out)
    spec, plan = job({"preset": "tiny-mixtral"}, {"tp": 4, "dp": 1})
    bad = describe(spec, plan)
    assert not bad["ok"] and any("key/value heads" in e for e in bad["errors"])
