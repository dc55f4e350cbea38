"""params.py against the real HF module tree for head widths other than hidden / heads and for q/k/v biases:
a tiny Qwen3 (head_dim != hidden / heads, per-head q/k norms), Qwen2 under arch llama (q/k/v biases),
Qwen3-0.6B's full shape on the meta device, and a pretrained Qwen2 directory whose config.json sets
head_dim."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.spec.schema import ModelSpec
from dsforge.runtime.models import build_hf


def _meta_count(config: Any) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_tiny_qwen3_with_a_wide_head_counts_exactly() -> None:
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=80, vocab_size=120, max_position_embeddings=64,
                      tie_word_embeddings=False)
    spec = ModelSpec(arch="qwen3", layers=2, hidden=48, heads=4, kv_heads=2, head_dim=32, ffn_hidden=80,
                     vocab=120, seq_len=64)
    assert _meta_count(cfg) == total_params(resolve_model(spec))


def test_qwen3_0_6b_shape_counts_exactly() -> None:
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                      tie_word_embeddings=True)
    spec = ModelSpec(arch="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128,
                     ffn_hidden=3072, vocab=151936, seq_len=4096, tied_embeddings=True)
    # Qwen3-0.6B's published count
    assert _meta_count(cfg) == total_params(resolve_model(spec)) == 596_049_920


def test_qwen2_under_arch_llama_counts_its_qkv_biases() -> None:
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24, intermediate_size=96, vocab_size=100, max_position_embeddings=64,
                      tie_word_embeddings=False)
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=24, ffn_hidden=96,
                     vocab=100, seq_len=64, qkv_bias=True)
    built = build_hf(spec, "meta")  # dsforge's own dense build of the same keys: Qwen2 (biases on q, k, v
                                    # only)
    assert type(built).__name__ == "Qwen2ForCausalLM"
    assert _meta_count(cfg) == sum(p.numel() for p in built.parameters()) == total_params(resolve_model(spec))
    assert total_params(resolve_model(ModelSpec(**{**spec.model_dump(),
                                                   "qkv_bias": False}))) < _meta_count(cfg)


@settings(max_examples=15, deadline=None)
@given(kv=st.integers(1, 3), per_kv=st.integers(1, 3), head_dim=st.sampled_from([4, 8, 12, 40]),
       width=st.integers(1, 12), ffn=st.integers(1, 64), tied=st.booleans(), bias=st.booleans(),
       arch=st.sampled_from(["llama", "mixtral"]))
def test_dense_builds_count_what_params_py_says(kv: int, per_kv: int, head_dim: int, width: int, ffn: int,
                                                tied: bool, bias: bool, arch: str) -> None:
    # hidden a multiple of heads (DSF121; transformers' Llama and Mixtral configs require it), head_dim free
    keys: dict[str, Any] = {"arch": arch, "layers": 2, "hidden": kv * per_kv * width, "heads": kv * per_kv,
                            "kv_heads": kv, "head_dim": head_dim, "ffn_hidden": ffn, "vocab": 50,
                            "seq_len": 16, "tied_embeddings": tied, "qkv_bias": bias and arch == "llama"}
    if arch == "mixtral":
        keys["moe"] = {"experts": 3, "top_k": 2}
    model = resolve_model(ModelSpec(**keys))
    assert sum(p.numel() for p in build_hf(model, "meta").parameters()) == total_params(model)


def test_pretrained_qwen2_with_its_own_head_dim_plans_the_real_count(tmp_path: Path) -> None:
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=96, vocab_size=100, max_position_embeddings=64,
                      tie_word_embeddings=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict()), encoding="utf-8")
    (ckpt / "model.safetensors").write_bytes(b"not read by the planner")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"version": 1, "model": {"pretrained": "ckpt"},
                                   "hardware": {"preset": "cpu-local"}}), encoding="utf-8")
    loaded, diags = load_job(job)
    assert loaded is not None, [d.message for d in diags]
    model = build_plan(loaded.spec).model
    assert (model.head_dim, model.qkv_bias) == (32, True)
    assert total_params(model) == _meta_count(cfg)
    job.write_text(yaml.safe_dump({"version": 1, "model": {"pretrained": "ckpt", "head_dim": 16},
                                   "hardware": {"preset": "cpu-local"}}), encoding="utf-8")
    loaded, diags = load_job(job)
    assert [(d.rule, d.path) for d in diags] == [("DSF013", ("model", "head_dim"))]
    assert "model.head_dim 16" in diags[0].message and "32" in diags[0].message
