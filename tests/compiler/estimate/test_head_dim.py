"""model.head_dim and model.qkv_bias in the estimates: stating the default changes nothing, and a head width
other than hidden / heads moves every attention term with heads x head_dim (no torch: the HF counts are in
tests/runtime_rewrite/test_head_dim_params.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.flops import layer_forward_flops
from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.model.params import layer_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import ModelSpec
from dsforge.compiler.validate import validate_file
from dsforge.explain.report import explain_plan


def _plan(tmp: Path, model: dict[str, Any], parallel: dict[str, Any], name: str) -> Plan:
    doc = {"version": 1, "model": model, "parallel": parallel,
           "hardware": {"preset": "dgx-h100", "nodes": 1},
           "training": {"global_batch": 16, "micro_batch": 1, "precision": "bf16"}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    assert job is not None, [d.message for d in diags]
    return build_plan(job.spec)


def _summary(plan: Plan) -> Any:
    return explain_plan(plan).summary


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(["gpt2", "llama", "mixtral"]), kv=st.sampled_from([1, 2, 4]),
       per_kv=st.sampled_from([1, 2]), head_dim=st.sampled_from([16, 64, 128]), layers=st.integers(2, 8),
       tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]),
       kind=st.sampled_from(["ring", "ulysses"]), zero=st.sampled_from([0, 1, 3]),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_stating_the_default_head_dim_and_qkv_bias_changes_no_estimate(
        arch: str, kv: int, per_kv: int, head_dim: int, layers: int, tp: int, pp: int, cp: int, kind: str,
        zero: int, recompute: str) -> None:
    heads = kv * per_kv * 2  # tp 2 and Ulysses' cp 2 divide the heads
    kv_heads = heads if arch == "gpt2" else kv * 2
    model: dict[str, Any] = {"arch": arch, "layers": layers, "hidden": heads * head_dim, "heads": heads,
                             "kv_heads": kv_heads, "vocab": 1000, "seq_len": 256}
    if arch == "mixtral":
        model["moe"] = {"experts": 4, "top_k": 2}
    parallel = {"tp": tp, "pp": pp, "cp": cp, "dp": 8 // (tp * pp * cp),
                "zero": zero if pp == 1 else min(zero, 1), "context_parallel": {"kind": kind}}
    with tempfile.TemporaryDirectory(prefix="h5-headdim-") as d:
        tmp = Path(d)
        base = _plan(tmp, model, parallel, "base")
        stated = _plan(tmp, {**model, "head_dim": head_dim, "qkv_bias": arch == "gpt2"}, parallel, "stated")
    assert base.model == stated.model
    assert _summary(base) == _summary(stated)


def _qwen3(**over: Any) -> ModelSpec:
    # Qwen3-0.6B's shape: hidden 1024, 16 heads of 128 (heads x head_dim = 2048), 8 KV heads
    keys: dict[str, Any] = {"arch": "qwen3", "layers": 28, "hidden": 1024, "heads": 16, "kv_heads": 8,
                            "head_dim": 128, "ffn_hidden": 3072, "vocab": 151936, "seq_len": 4096,
                            "tied_embeddings": True, **over}
    return ModelSpec(**keys)


def test_projection_flops_are_twice_the_attention_weights_at_any_head_dim() -> None:
    for head_dim in (32, 64, 128, 256):
        m = resolve_model(_qwen3(head_dim=head_dim))
        p, f = layer_params(m), layer_forward_flops(m)
        assert f.attention_proj == 2 * p.attention  # one multiply-add per weight and token (no biases in
                                                    # Qwen3)
        # scores and weighted sum over heads x head_dim
        assert f.attention_core == 4.0 * m.seq_len * 16 * head_dim
    wide, narrow = resolve_model(_qwen3()), resolve_model(_qwen3(head_dim=64))
    assert layer_params(wide).attention == 2 * layer_params(narrow).attention


def test_qkv_bias_adds_the_three_column_biases() -> None:
    plain = resolve_model(ModelSpec(arch="llama", layers=1, hidden=64, heads=4, kv_heads=2, head_dim=32,
                                    vocab=8, seq_len=8))
    biased = resolve_model(ModelSpec(arch="llama", layers=1, hidden=64, heads=4, kv_heads=2, head_dim=32,
                                     vocab=8, seq_len=8, qkv_bias=True))
    assert not plain.qkv_bias and resolve_model(ModelSpec(arch="gpt2", layers=1, hidden=64, heads=4, vocab=8,
                                                          seq_len=8)).qkv_bias
    assert layer_params(biased).attention - layer_params(plain).attention == 4 * 32 + 2 * 2 * 32


def test_a_stated_head_dim_still_needs_hidden_a_multiple_of_heads(tmp_path: Path) -> None:
    # transformers' LlamaConfig refuses hidden % heads != 0 even with head_dim set: validate must refuse it
    # first
    doc = {"version": 1, "model": {"arch": "llama", "layers": 2, "hidden": 100, "heads": 8, "kv_heads": 4,
                                   "head_dim": 16, "vocab": 256, "seq_len": 64},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"tp": 2, "dp": 1}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert "DSF121" in {d.rule for d in validate_file(tmp_path / "a.yaml").diagnostics}


def test_head_dim_bounds_are_checked(tmp_path: Path) -> None:
    for bad in (0, -1, 2**16 + 1, "wide", True):
        doc = {"version": 1, "model": {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256,
                                       "seq_len": 64, "head_dim": bad}, "hardware": {"preset": "cpu-local"}}
        (tmp_path / "j.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
        diags = validate_file(tmp_path / "j.yaml").diagnostics
        assert any(d.path == ("model", "head_dim") for d in diags), (bad,
                                                                     [(d.rule, d.message) for d in diags])


def test_a_wider_head_moves_every_attention_term(tmp_path: Path) -> None:
    # Qwen3-0.6B's widths under arch llama: 16 heads of 128 (2048 channels) against the default 1024 / 16 =
    # 64; the wide model has half the KV heads, so K and V keep their width and only Q, O and the core grow
    model = {"arch": "llama", "layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 8, "ffn_hidden": 3072,
             "vocab": 4096, "seq_len": 2048}
    parallel = {"tp": 2, "cp": 2, "dp": 2, "context_parallel": {"kind": "ring"}}
    narrow_plan = _plan(tmp_path, model, parallel, "narrow")
    wide_plan = _plan(tmp_path, {**model, "head_dim": 128, "kv_heads": 4}, parallel, "wide")
    narrow, wide = _summary(narrow_plan), _summary(wide_plan)
    # Q and O double: 2 x 1024 x 16 x 64 more weights per layer
    assert wide["params"]["total"] - narrow["params"]["total"] == 4 * 2 * 1024 * 16 * 64

    def ring(s: Any) -> list[float]:
        return [c["payload_bytes"] for c in s["communication"]["collectives"] if c["group"] == "cp"]

    assert ring(wide) == ring(narrow) and ring(narrow)  # K/V chunks: kv_heads x head_dim, 4 x 128 = 8 x 64
    # the backward moment's activations (with the lean kernels the peak of this small model is the update)
    def held(plan: Plan) -> list[float]:
        return [st.moments["backward"]["activations"] for st in estimate_memory(plan).stages]

    act = held(narrow_plan)
    assert act and all(a > 0 for a in act) and all(w > n for w, n in zip(held(wide_plan), act))
    assert wide["time"]["compute_s"] > narrow["time"]["compute_s"]
    assert wide["flops"]["model_per_token"] > narrow["flops"]["model_per_token"]


@settings(max_examples=15, deadline=None)
@given(head_dim=st.sampled_from([8, 16, 48]), bias=st.booleans(), kv=st.sampled_from([1, 2, 4]))
def test_one_rank_holds_every_parameter_params_py_counts(head_dim: int, bias: bool, kv: int) -> None:
    # shares.py lists each tensor (q, k, v, o, their biases) apart from params.py's sums: at tp 1 they agree
    from dsforge.compiler.estimate.shares import stage_share
    from dsforge.compiler.model.params import total_params

    model = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": kv, "vocab": 256,
             "seq_len": 64, "head_dim": head_dim, "qkv_bias": bias}
    with tempfile.TemporaryDirectory(prefix="h5-headdim-") as d:
        plan = _plan(Path(d), model, {"tp": 1, "dp": 8}, "one")
    assert stage_share(plan, 0, 0.0).total == total_params(plan.model)
