"""The job schema: parse_job never raises, schema errors read as one sentence per mistake, docs render."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import parse_job
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.rules.registry import Context, run_rules
from dsforge.compiler.spec.json_schema import job_schema
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.spec.spec_types import FrozenSpecError

VALID: dict[str, Any] = {
    "version": 1,
    "model": {"preset": "tiny-llama"},
    "hardware": {"preset": "cpu-local", "gpus_per_node": 4},
    "parallel": {"tp": 2, "zero": 1},
    "training": {"global_batch": 8, "micro_batch": 2, "precision": "fp32"},
}


def _parse(data: dict[str, Any]):
    return parse_job(data, SourceMap("job.yaml"))


def _one(data: dict[str, Any]) -> tuple[str, str, str]:
    spec, diags = _parse(data)
    assert spec is None and len(diags) == 1, [d.message for d in diags]
    return diags[0].rule, diags[0].key_path, diags[0].message


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(VALID)
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return data


def test_valid_job_parses_and_fills_defaults() -> None:
    spec, diags = _parse(VALID)
    assert not diags and spec is not None
    assert spec.model.kv_heads == 2 and spec.model.activation == "swiglu" and spec.model.position == "rope"
    assert spec.parallel.dp == "auto" and spec.training.optimizer.name == "adamw"


def test_defaults_follow_the_architecture() -> None:
    model = {"arch": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}
    spec, _ = _parse(_with(("model",), model))
    assert spec is not None
    assert (spec.model.kv_heads, spec.model.ffn_hidden, spec.model.activation) == (4, 256, "gelu")


@pytest.mark.parametrize("path, value, rule, words", [
    (("parallel", "zero"), 5, "DSF022", "<= 3"),
    (("parallel", "zero"), "two", "DSF023", "one of auto, or an integer >= 0 and <= 3"),
    (("parallel", "zero"), True, "DSF021", "an integer >= 0 and <= 3 or `auto`"),
    (("parallel", "tp"), 0, "DSF022", ">= 1"),
    (("parallel", "tp"), True, "DSF021", "whole number"),
    (("parallel", "tp"), "auto", None, ""),
    (("parallel", "pipeline", "partition"), [0, 2], "DSF022", ">= 1"),
    (("parallel", "pipeline", "partition"), "unifrom", "DSF023", "did you mean `uniform`"),
    (("parallel", "pipeline"), 3, "DSF021", "mapping"),
    (("training", "precision"), "bf61", "DSF023", "did you mean `bf16`"),
    (("training", "global_batch"), "8", "DSF021", "integer"),
    (("training", "optimizer", "betas"), [0.9], "DSF022", "too few items"),
    (("model", "factory"), "nope", "DSF022", "package.module:callable"),
    (("paralel",), {}, "DSF020", "did you mean `parallel`"),
    (("parallel", "tensor_parallel"), 2, "DSF020", "unknown key `tensor_parallel` in parallel"),
    (("version",), 2, "DSF023", "one of 1"),
])
def test_schema_errors_are_one_sentence_per_mistake(path, value, rule, words) -> None:
    spec, diags = _parse(_with(path, value))
    if rule is None:
        assert spec is not None and not diags
        return
    assert [d.rule for d in diags] == [rule], [d.message for d in diags]
    assert words in diags[0].message and diags[0].fix


def test_missing_keys_are_grouped_per_section() -> None:
    rule, _where, message = _one(_with(("model",), {"layers": 2, "hidden": 64}))
    assert rule == "DSF024" and "`heads`, `vocab`, `seq_len`" in message and "preset" not in message
    _spec, diags = _parse({"version": 1})
    assert {d.message for d in diags} == {"the job file is missing required keys `model`, `hardware`"}


def test_unknown_preset_suggests_the_closest_name() -> None:
    rule, where, message = _one(_with(("model", "preset"), "llama3-9b"))
    assert (rule, where) == ("DSF025", "model.preset") and "llama3-8b" in message


def test_schema_diagnostics_point_at_written_values() -> None:
    from dsforge.compiler.frontend.source import load_yaml

    raw, smap = load_yaml("version: 1\nmodel: {preset: tiny-llama}\nhardware: {preset: cpu-local}\n"
                          "parallel:\n  zero: 7\n", "job.yaml")
    _, diags = parse_job(raw, smap)
    assert [(d.rule, d.location.line, d.location.column) for d in diags] == [("DSF022", 5, 9)]


def test_json_schema_documents_every_section() -> None:
    schema = job_schema()
    assert schema["required"] == ["version"] and "extends" in schema["properties"]
    defs = schema["definitions"]
    for name in ("ModelSpec", "HardwareSpec", "ParallelSpec", "TrainingSpec"):
        assert all(
            p.get("description") or "$ref" in p or "allOf" in p for p in defs[name]["properties"].values()
        ), name
    assert "required" not in defs["ModelSpec"]  # presets may supply any model key
    assert defs["ParallelSpec"]["properties"]["tp"]["anyOf"][1] == {"const": "auto"}


def test_model_copy_is_frozen() -> None:
    spec, _ = _parse(VALID)
    assert spec is not None
    with pytest.raises(FrozenSpecError):
        spec.parallel.tp = 4  # type: ignore[misc]
    assert isinstance(spec, JobSpec)


# ---- property test: arbitrary JSON-like data never makes parse_job (or the rules) raise ----

_KEYS = st.sampled_from(["version", "model", "hardware", "parallel", "training", "deepspeed", "preset", "tp",
                         "pp", "dp", "cp", "ep", "zero", "layers", "heads", "kv_heads", "moe", "experts",
                         "pipeline", "partition", "optimizer", "name", "global_batch", "micro_batch", "bf16",
                         "fp16", "zero_optimization", "stage", "tensor_parallel", "autotp_size", "x"])
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True), st.text(max_size=6),
              st.sampled_from(["auto", "tiny-llama", "cpu-local", "bf16", "interleaved", "ulysses",
                               "tokens"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=10)
_paths = st.lists(_KEYS, min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _json, max_size=6))
def test_arbitrary_mappings_never_raise(data: dict[str, Any]) -> None:
    _parse(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_paths, _json), min_size=1, max_size=3))
def test_mutated_valid_jobs_never_raise_and_rules_never_crash(edits: list[tuple[list[str], Any]]) -> None:
    data = copy.deepcopy(VALID)
    for path, value in edits:
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    spec, diags = _parse(data)
    if spec is None:
        assert diags and all(d.rule.startswith("DSF0") for d in diags)
        return
    found = run_rules(Context(spec, build_plan(spec), SourceMap("job.yaml"), data))
    assert not [d.message for d in found if d.rule == "DSF900"]
