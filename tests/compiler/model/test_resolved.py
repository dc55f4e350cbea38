"""The resolved model: every default filled once, the same values the job spec states after parsing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import parse_job
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.model.params import embedding_params, head_params, is_moe_layer, layer_params
from dsforge.compiler.model.resolved import ResolvedModel, resolve_model
from dsforge.compiler.plan.plan import balanced_partition, build_plan, layer_weights, parameter_partition
from dsforge.compiler.spec.schema import ModelSpec

#: The keys a job may leave unset because they follow from others.
DERIVED = ("kv_heads", "ffn_hidden", "activation", "position")

models = st.fixed_dictionaries(
    {"arch": st.sampled_from(["gpt2", "llama", "mixtral", "custom", "auto"]), "layers": st.integers(1, 8),
     "hidden": st.sampled_from([64, 96, 128]), "heads": st.sampled_from([1, 2, 4]),
     "vocab": st.integers(1, 512), "seq_len": st.integers(1, 256)},
    optional={"kv_heads": st.sampled_from([1, 2, 4]), "ffn_hidden": st.integers(1, 512),
              "activation": st.sampled_from(["gelu", "swiglu"]),
              "position": st.sampled_from(["learned", "rope"]), "tied_embeddings": st.booleans(),
              "vocab_multiple_of": st.sampled_from([8, 64, 128]),
              "moe": st.fixed_dictionaries({"experts": st.integers(1, 8)},
                                           optional={"ffn_hidden": st.integers(1, 512),
                                                     "every": st.integers(1, 4),
                                                     "top_k": st.integers(1, 2)})})


def _parsed(model: dict[str, Any]) -> ModelSpec:
    data = {"version": 1, "model": model, "hardware": {"preset": "cpu-local"}}
    spec, diags = parse_job(data, SourceMap("job.yaml"))
    assert spec is not None, diags
    return spec.model


@settings(max_examples=150, deadline=None)
@given(models)
def test_resolving_fills_what_parsing_states(model: dict[str, Any]) -> None:
    raw = ModelSpec.model_validate(model)
    resolved = resolve_model(raw)
    # The spec after parsing (what plan.json stores) and the resolved model agree field by field...
    filled = _parsed(model)
    assert resolve_model(filled) == resolved
    for name in DERIVED:
        assert getattr(filled, name) == getattr(resolved, name) is not None
    if raw.moe is not None:
        assert filled.moe is not None and resolved.moe is not None
        assert filled.moe.ffn_hidden == resolved.moe.ffn_hidden == (raw.moe.ffn_hidden or resolved.ffn_hidden)
    # ...and values the job wrote are kept as written.
    for name, value in model.items():
        if name != "moe":
            assert getattr(resolved, name) == value


@pytest.mark.parametrize("arch, activation, position", [
    ("gpt2", "gelu", "learned"), ("llama", "swiglu", "rope"), ("mixtral", "swiglu", "rope"),
    ("custom", "gelu", "learned"), ("auto", "gelu", "learned")])
def test_defaults_follow_the_architecture(arch: str, activation: str, position: str) -> None:
    r = resolve_model(ModelSpec(arch=arch, layers=2, hidden=64, heads=4, vocab=256, seq_len=32,
                                moe={"experts": 4}))
    assert (r.kv_heads, r.ffn_hidden, r.activation, r.position) == (4, 256, activation, position)
    assert r.moe is not None and r.moe.ffn_hidden == 256


def test_resolved_model_mirrors_the_model_section() -> None:
    # Same names as the job's keys, so a factory or reader written against the section reads the same.
    assert {f.name for f in dataclasses.fields(ResolvedModel)} == set(ModelSpec.model_fields)
    r = resolve_model(ModelSpec(arch="llama", layers=2, hidden=64, heads=4, vocab=256, seq_len=32))
    assert resolve_model(r) is r
    assert hash(r) == hash(resolve_model(ModelSpec(arch="llama", layers=2, hidden=64, heads=4, vocab=256,
                                                   seq_len=32)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.kv_heads = 1  # type: ignore[misc]  # the assignment is what is under test


@settings(max_examples=60, deadline=None)
@given(models, st.sampled_from([1, 2, 4]))
def test_cached_layer_weights_are_the_layer_counts(model: dict[str, Any], tp: int) -> None:
    m = resolve_model(ModelSpec.model_validate(model))
    expected = [layer_params(m, is_moe_layer(m, i)).total for i in range(m.layers)]
    expected[0] += embedding_params(m, tp)
    expected[-1] += head_params(m, tp)
    assert layer_weights(m, tp) == tuple(expected)
    assert layer_weights(m, tp) is layer_weights(resolve_model(ModelSpec.model_validate(model)), tp)
    for chunks in (1, 2, 3):
        assert list(parameter_partition(m, tp, chunks)) == balanced_partition(expected, chunks)


def test_plan_model_is_resolved_from_an_unfilled_spec() -> None:
    spec, _ = parse_job({"version": 1, "model": {"preset": "gpt2-small"},
                         "hardware": {"preset": "cpu-local"}},
                        SourceMap("job.yaml"))
    assert spec is not None
    unfilled = spec.model_copy(update={"model": spec.model.model_copy(update={n: None for n in DERIVED})})
    assert build_plan(unfilled).model == build_plan(spec).model
    assert build_plan(spec).model.kv_heads == spec.model.heads
