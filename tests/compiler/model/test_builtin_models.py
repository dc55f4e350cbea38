"""DSF145: validate refuses exactly the model specs dsforge's own HF families cannot build, and every spec it
lets through builds (on the meta device) with the parameter count the compiler plans with."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.model.builtin_models import NotBuiltIn, builtin_problem
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.spec.schema import ModelSpec

torch = pytest.importorskip("torch")
models = pytest.importorskip("dsforge.runtime.models")


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([None, 1, 2, heads]))
    moe = draw(st.sampled_from([None, {"experts": 4, "top_k": 2, "ffn_hidden": 32},
                                {"experts": 4, "top_k": 2, "ffn_hidden": 32, "every": 2}]))
    return ModelSpec(arch=draw(st.sampled_from(["gpt2", "llama", "mixtral", "auto", "custom", "qwen3"])),
                     layers=2, hidden=32, heads=heads, kv_heads=kv if kv is None or kv <= heads else heads,
                     head_dim=draw(st.sampled_from([None, 8, 16])),
                     qkv_bias=draw(st.sampled_from([None, True, False])), ffn_hidden=64, vocab=64, seq_len=16,
                     activation=draw(st.sampled_from([None, "gelu", "swiglu"])),
                     position=draw(st.sampled_from([None, "learned", "rope"])), moe=moe)


@pytest.mark.slow  # builds up to 60 HF models on the meta device (~4-8 s)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_validate_refuses_what_the_runtime_cannot_build_and_nothing_else(spec: ModelSpec) -> None:
    model = resolve_model(spec)
    try:
        problem = builtin_problem(model)
    except NotBuiltIn as exc:
        with pytest.raises(models.ModelBuildError, match="model.factory"):
            models.hf_config(model)
        assert "model.factory" in str(exc)
        return
    if problem is not None:
        with pytest.raises(models.ModelBuildError) as raised:
            models.hf_config(model)
        assert problem[1] in str(raised.value)
        return
    built = models.build_hf(model, device="meta")
    assert sum(p.numel() for p in built.parameters()) == total_params(model)


def test_a_gpt2_with_grouped_query_attention_is_named_at_its_family() -> None:
    found = builtin_problem(resolve_model(ModelSpec(arch="gpt2", layers=2, hidden=32, heads=4, kv_heads=2,
                                                    vocab=64, seq_len=16)))
    assert found is not None and found[0] == "gpt2" and "grouped-query" in found[1]
