"""`arch: custom` rules on a non-HF model, `arch: auto` detection, rule precedence, factory errors, policy
text."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dsforge.compiler.model.rewrite_policies import DETECT_ORDER, POLICIES
from dsforge.runtime.models import ModelBuildError, build_model, hf_config
from dsforge.runtime.rewrite import RewriteError, describe, detect_arch, plan_rewrite
from dsforge.runtime.rewrite.shard import Heads, shard_tensor_parallel
from tests.runtime_rewrite.toy_models import Toy

TOY = {"arch": "custom", "factory": "tests.runtime_rewrite.toy_models:build", "layers": 2, "hidden": 64,
       "heads": 4, "ffn_hidden": 128, "vocab": 256, "seq_len": 32}
TOY_RULES = [
    {"match": "tok", "as": "vocab"},
    {"match": r"blocks\.\d+\.qkv", "as": "column", "fused": 3},
    {"match": r"blocks\.\d+\.out", "as": "row"},
    {"match": r"blocks\.\d+\.fc1", "as": "column"},
    {"match": r"blocks\.\d+\.fc2", "as": "row"},
    {"match": r"blocks\.\d+\.norm|final", "as": "replicate"},
    {"match": "head", "as": "vocab"},
]


def _shapes(rp, name):
    return {p.name: (p.shape, p.shard) for p in rp.module(name).params}


def test_custom_rules_place_a_toy_model(job):
    spec, plan = job(TOY, {"tp": 2}, TOY_RULES)
    rp = plan_rewrite(spec.model, plan)
    assert rp.arch == "custom" and rp.layer_list == "blocks"
    assert _shapes(rp, "blocks.1.qkv") == {"weight": ((192, 64), (96, 64)), "bias": ((192,), (96,))}
    assert _shapes(rp, "blocks.0.out") == {"weight": ((64, 64), (64, 32)), "bias": ((64,), (64,))}
    assert rp.module("blocks.0.qkv").rule == "rewrite[1]"
    assert rp.total_params == sum(p.numel() for p in Toy(spec.model).parameters())
    assert [m.layer for m in rp.modules if m.name.startswith("blocks.1.")] == [1] * 5


def test_custom_list_of_experts_split_over_ep(job):
    moe = {**TOY, "moe": {"experts": 4, "top_k": 2}}
    rules = TOY_RULES + [{"match": r"blocks\.\d+\.router", "as": "replicate"},
                         {"match": r"blocks\.\d+\.experts", "as": "expert"}]
    spec, plan = job(moe, {"dp": 1, "ep": 1, "tp": 2}, rules)
    rp = plan_rewrite(spec.model, plan)
    assert _shapes(rp, "blocks.0.experts") == {  # at ep 1 every rank keeps every expert
        "w_in.weight": ((4, 128, 64), (4, 128, 64)), "w_in.bias": ((4, 128), (4, 128)),
        "w_out.weight": ((4, 64, 128), (4, 64, 128)), "w_out.bias": ((4, 64), (4, 64))}
    assert rp.total_params == sum(p.numel() for p in Toy(spec.model).parameters())
    # ep 2: the block (its router is `router`) is not one DeepSpeed's MoE layer is built from, refused at plan
    # time (the applier refused it when the run started)
    spec, plan = job(moe, {"dp": 2, "ep": 2}, rules)
    with pytest.raises(RewriteError, match="blocks.0.experts .*Block has no `gate`: use ep 1"):
        plan_rewrite(spec.model, plan)
    spec, plan = job({**moe, "moe": {"experts": 3, "top_k": 2}}, {"dp": 2, "ep": 2}, rules)
    with pytest.raises(RewriteError, match="ep=2 does not divide its 3 experts"):
        plan_rewrite(spec.model, plan)


def test_custom_model_with_missing_rules_names_what_is_left(job):
    spec, plan = job(TOY, {"tp": 2}, TOY_RULES[:4])
    with pytest.raises(RewriteError) as err:
        plan_rewrite(spec.model, plan)
    assert err.value.leftover == ["blocks.0.norm", "blocks.0.fc2", "blocks.1.norm", "blocks.1.fc2", "final",
                                  "head"]
    assert "blocks.{0..1}.norm, blocks.{0..1}.fc2, final, head" in str(err.value)


def test_custom_needs_rules_and_right_module_kinds(job):
    spec, plan = job(TOY, {"tp": 2})
    with pytest.raises(RewriteError, match="has none"):
        plan_rewrite(spec.model, plan)
    spec, plan = job(TOY, {"tp": 2}, [{"match": r"blocks\.\d+\.norm", "as": "column"}] + TOY_RULES)
    with pytest.raises(RewriteError, match=r"blocks\.0\.norm .*needs a Linear or "
                                           r"HF Conv1D module, not LayerNorm"):
        plan_rewrite(spec.model, plan)


def test_user_rules_take_precedence_and_unused_ones_warn(job):
    rules = [{"match": r"model\.layers\.\d+\.mlp\.down_proj", "as": "replicate"},
             {"match": "nothing", "as": "row"}]
    spec, plan = job({"preset": "tiny-llama"}, {"tp": 2}, rules)
    rp = plan_rewrite(spec.model, plan)
    down = rp.module("model.layers.2.mlp.down_proj")
    assert (down.variant, down.rule, down.params[0].shard) == ("replicate", "rewrite[0]", (64, 128))
    assert rp.warnings == ["rewrite[1] matched no module"]


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_auto_detects_each_family_from_modules(job, preset):
    spec, _ = job({"preset": preset})
    model = build_model(spec.model, "meta")
    found, _ = detect_arch(model)
    assert found == spec.model.arch
    _, plan = job({"preset": preset, "arch": "auto"}, {"tp": 2})
    assert plan_rewrite(model, plan).arch == spec.model.arch


def test_auto_on_a_factory_model_and_on_an_unknown_one(job):
    llama = {**TOY, "arch": "auto", "factory": "tests.runtime_rewrite.toy_models:build_llama", "hidden": 32,
             "vocab": 128}
    spec, plan = job(llama, {"tp": 2})  # the job leaves kv_heads = heads = 4; the factory's model has 2
    with pytest.raises(RewriteError,
                       match="16 features per block are not the 4 key/value heads x head_dim 8"):
        plan_rewrite(spec.model, plan)
    spec, plan = job({**llama, "kv_heads": 2}, {"tp": 2})
    assert plan_rewrite(spec.model, plan).arch == "llama"
    spec, plan = job({**TOY, "arch": "auto"}, {"tp": 2})
    with pytest.raises(RewriteError) as err:
        plan_rewrite(spec.model, plan)
    text = str(err.value)
    assert "recognises none" in text and "llama: no module matches" in text and "arch: custom" in text
    found, reasons = detect_arch(Toy(spec.model))
    assert found is None and set(reasons) == set(DETECT_ORDER)


@pytest.mark.parametrize("factory, message", [
    ("nope_pkg.models:build", "cannot import module 'nope_pkg.models'"),
    ("tests.runtime_rewrite.toy_models:missing", "has no attribute 'missing'"),
    ("tests.runtime_rewrite.toy_models:not_a_module", "returned a Tensor, not a torch nn.Module"),
    ("tests.runtime_rewrite.toy_models:broken", "raised RuntimeError: weights not found"),
])
def test_factory_errors_say_what_failed(job, factory, message):
    spec, plan = job({**TOY, "factory": factory}, {"tp": 2}, TOY_RULES)
    with pytest.raises(ModelBuildError, match=message):
        build_model(spec.model)
    out = describe(spec, plan)
    assert not out["ok"] and message in out["errors"][0]


def test_hf_families_refuse_specs_they_cannot_express(job):
    spec, _ = job({"preset": "tiny-gpt2", "kv_heads": 2})
    with pytest.raises(ModelBuildError, match="no grouped-query attention"):
        hf_config(spec.model)
    spec, _ = job({"preset": "tiny-mixtral", "moe": {"experts": 4, "every": 2}})
    with pytest.raises(ModelBuildError, match="every: 1"):
        hf_config(spec.model)


def test_fused_heads_shard_arithmetic():
    spec = Heads(heads=4, kv_heads=4, head_dim=16)
    ok = shard_tensor_parallel("column", "conv1d", {"weight": (64, 192), "bias": (192,)}, 4, 3, "q", spec)
    assert [p.shard for p in ok.params] == [(64, 48), (48,)] and not ok.problems
    bad = shard_tensor_parallel("column", "conv1d", {"weight": (64, 192)}, 8, 3, "q", spec)
    assert bad.problems == ["tp=8 does not divide its 4 query heads: each rank must own whole heads"]
    wrong = shard_tensor_parallel("column", "linear", {"weight": (96, 64)}, 2, 1, "q", spec)
    assert "not the 4 query heads" in wrong.problems[0]


def test_policy_tables_are_plain_data():
    qkv = POLICIES["gpt2"].rows[3]  # GPT-2's fused c_attn: Q, K and V side by side, split by query heads
    assert (qkv.variant, qkv.fused, qkv.heads) == ("column", 3, "q")
    assert all(row.variant in {"column", "row", "vocab", "norm", "head_norm", "shard_norm", "replicate",
                               "expert"}
               for p in POLICIES.values() for row in p.rows)


def test_description_renders_for_explain(job):
    from dsforge.compiler.model.rewrite_policies import format_description

    spec, plan = job({"preset": "tiny-gpt2"}, {"tp": 2})
    lines = format_description(describe(spec, plan))
    assert lines[0] == "rewrite plan (gpt2, tp=2, ep=1):"
    assert "  column    transformer.h.{0..1}.attn.c_attn: weight 64x192 -> 64x96, bias 192 -> 96" in lines
    assert any(line.startswith("  vocab     lm_head (tied to transformer.wte)") for line in lines)
    spec, plan = job({"preset": "tiny-gpt2"}, {"tp": 8})
    bad = format_description(describe(spec, plan))
    assert bad[0] == "rewrite plan (gpt2): cannot place the model" and "tp=8 does not divide" in bad[1]
