"""The rule registry and the checks: isolation of crashing rules, messages, fixes and locations."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import parse_job
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.rules.registry import Context, Finding, Rule, all_rules, rule, run_rules
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity


def _diags(write_job, text: str) -> list[tuple[str, int, str, str]]:
    result = validate_file(write_job(text))
    assert not result.unusable, [d.message for d in result.diagnostics]
    return [(d.rule, d.location.line, d.message, d.fix) for d in result.diagnostics]


BASE = """version: 1
model:
  preset: tiny-llama
hardware:
  preset: cpu-local
  gpus_per_node: 4
"""


def test_every_rule_is_documented_and_sourced() -> None:
    rules = all_rules()
    assert len(rules) >= 25 and [r.id for r in rules] == sorted(r.id for r in rules)
    for r in rules:
        assert re.fullmatch(r"DSF\d{3}", r.id), r.id
        assert r.summary and r.source, r.id
        assert len(r.rationale) > 40, f"{r.id} needs a docstring saying why it exists"


def test_registering_an_id_twice_is_refused() -> None:
    existing = all_rules()[0]
    with pytest.raises(ValueError, match="registered twice"):
        rule(existing.id, "again")(lambda ctx: iter(()))


def test_a_crashing_rule_becomes_dsf900_and_the_others_still_run(write_job) -> None:
    def broken(ctx: Context):
        raise ZeroDivisionError("boom")

    rules = [Rule("DSF999", Severity.ERROR, "broken", "test", broken, origin="test-plugin")] + all_rules()
    result = validate_file(write_job(BASE + "parallel: {tp: 4, zero: 1}\n"), rules)
    rules_seen = [d.rule for d in result.diagnostics]
    assert "DSF104" in rules_seen  # tp=4 does not divide kv_heads=2: the real rules kept running
    (crash,) = [d for d in result.diagnostics if d.rule == "DSF900"]
    assert "DSF999 (test-plugin)" in crash.message and "ZeroDivisionError: boom" in crash.message


def test_kv_heads_message_and_fix(write_job) -> None:
    (found,) = _diags(write_job, BASE + "parallel:\n  tp: 4\n  zero: 1\n")
    assert found == ("DSF104", 8, ("tp=4 does not divide kv_heads=2: each "
                                   "tensor-parallel rank must own whole KV heads"),
                     "use tp in {1, 2}, or set kv_heads to a multiple of 4")
    replicated = "parallel:\n  tp: 4\n  zero: 1\n  replicate_kv_heads: true\n"
    # DSF104 accepts the stated replication; dsforge's own runtime cannot build it (DSF143), another stack can
    assert [d[0] for d in _diags(write_job, BASE + replicated)] == ["DSF143"]
    if "stack" in JobSpec.model_fields:
        assert not _diags(write_job, "stack: megatron-te\n" + BASE + replicated)
        # so only there does the fix offer the replication
        (other,) = _diags(write_job, "stack: megatron-te\n" + BASE + "parallel:\n  tp: 4\n  zero: 1\n")
        assert other[3] == ("use tp in {1, 2}, or set kv_heads to a multiple of 4, or set "
                            "parallel.replicate_kv_heads: true")


def test_value_from_a_preset_points_at_the_preset(write_job) -> None:
    found = _diags(write_job, "version: 1\nmodel:\n  preset: tiny-llama\n  "
                              "heads: 3\nhardware: {preset: cpu-local}\n")
    # heads=3 was written (line 4); kv_heads=2 and hidden=64 come from the preset (line 3)
    assert [(r, line) for r, line, *_ in found] == [("DSF122", 3), ("DSF121", 4)]
    found = _diags(write_job, "version: 1\nmodel:\n  preset: tiny-llama\nhardware: {preset: cpu-local}\n"
                   "parallel: {tp: 2, sequence_parallel: true}\ntraining: {global_batch: 2}\n")
    assert found == []
    found = _diags(write_job, "version: 1\nmodel:\n  preset: tiny-llama\n  vocab: 251\n"
                   "hardware: {preset: cpu-local}\nparallel: {tp: 2}\ntraining: {global_batch: 2}\n")
    assert [(r, line) for r, line, *_ in found] == [("DSF106", 4), ("DSF107", 4)]


def test_batch_rules_wait_until_the_layout_fills_the_world(write_job) -> None:
    found = _diags(write_job,
                   BASE + "parallel: {tp: 2, dp: 4}\ntraining: {global_batch: 7, micro_batch: 1}\n")
    assert [r for r, *_ in found] == ["DSF101"]  # not also DSF201 against a dp that cannot exist


def test_global_batch_fix_offers_valid_neighbours(write_job) -> None:
    ((rule_id, _, message, fix),) = _diags(write_job, BASE + "training: {global_batch: 10, micro_batch: 1}\n")
    assert rule_id == "DSF201" and "10/4" in message
    assert fix == "use global_batch 8 or 12"  # no micro_batch makes 10 split over dp=4
    ((_, _, _, fix),) = _diags(write_job, BASE + "training: {global_batch: 24, micro_batch: 5}\n")
    assert fix == "use global_batch 20 or 40, or micro_batch in {1, 2, 3, 6}"


def test_bubble_warning_states_the_fraction_and_the_cure(write_job) -> None:
    (found,) = _diags(write_job, BASE + "parallel: {pp: 4, zero: 1}\ntraining: "
                                        "{global_batch: 5, micro_batch: 1}\n")
    assert found[0] == "DSF204" and "38% of each step (p=4, m=5)" in found[2]
    assert ">= 9 micro-batches" in found[3]  # (p-1)/(m+p-1) <= 1/4  <=>  m >= 3(p-1)
    assert not _diags(write_job, BASE + "parallel: {pp: 4, zero: 1}\ntraining: "
                                        "{global_batch: 9, micro_batch: 1}\n")


def test_tp_across_nodes_names_both_bandwidths(write_job) -> None:
    text = ("version: 1\nmodel: {preset: tiny-llama, hidden: 256, heads: 16, kv_heads: 16}\n"
            "hardware: {preset: dgx-h100, nodes: 2}\nparallel: {tp: 16, zero: 1}\n"
            "training: {global_batch: 16, micro_batch: 1}\nlaunch: {launcher: slurm}\n")
    (found,) = _diags(write_job, text)
    assert found[0] == "DSF401" and "450 GB/s inside a node to 50 GB/s between nodes (9x slower)" in found[2]


def test_ulysses_allows_replicated_kv_heads(write_job) -> None:
    def job(heads: int, kv_heads: int) -> str:
        return (f"version: 1\nmodel: {{preset: tiny-llama, hidden: 96, heads: {heads}, kv_heads: "
                f"{kv_heads}}}\nhardware: {{preset: cpu-local, gpus_per_node: 4}}\n"
                "parallel: {cp: 4, zero: 1, context_parallel: {kind: ulysses}}\n")

    assert not _diags(write_job, job(8, 2))  # 2 KV heads replicated over cp=4
    assert not _diags(write_job, job(8, 8))  # 8 KV heads split 2 per rank
    found = _diags(write_job, job(12, 6))  # 6 KV heads: cp=4 neither divides nor is a multiple of them
    assert [r for r, *_ in found] == ["DSF112"] and "6 KV head(s)" in found[0][2]


def test_deepspeed_override_typo_suggests_the_key(write_job) -> None:
    found = _diags(write_job, BASE + "deepspeed:\n  bf16: {enabeld: true}\n  "
                                     "tensor_paralel: {autotp_size: 2}\n")
    assert [(r, line) for r, line, *_ in found] == [("DSF507", 8), ("DSF507", 9)]
    assert "did you mean `enabled`" in found[0][2] and "rejects it at parse" in found[0][2]
    assert "did you mean `tensor_parallel`" in found[1][2] and "ignored" in found[1][2]


def test_degree_overrides_must_match_the_plan(write_job) -> None:
    found = _diags(write_job, BASE + "parallel: {tp: 2}\ndeepspeed:\n  tensor_parallel: {autotp_size: 4}\n"
                   "  sequence_parallel_size: 1\n")
    assert [(r, m) for r, _, m, _ in found if r == "DSF508"] == [
        ("DSF508", "deepspeed.tensor_parallel.autotp_size=4 contradicts parallel.tp=2")]
    # validate also reports what compile refuses: DeepSpeed would lay out the ranks itself (DSF606), and the
    # tensor_parallel section is not an override dsforge takes at all (DSF528)
    assert sorted(r for r, *_ in found) == ["DSF508", "DSF528", "DSF606", "DSF606"]


# ---- property: rules never crash on well-typed jobs, and every finding has a message and a fix ----

_deg = st.one_of(st.integers(1, 8), st.just("auto"))
_ds_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.text(max_size=4),
                                   st.sampled_from(["sum", "fp8", "bf16", "autosp", "autotp", "z1"])),
                         lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                 st.dictionaries(st.sampled_from(
                                                     ["enabled", "stage", "autotp_size", "tp", "tp_size",
                                                      "passes", "loss_scale", "overlap_comm",
                                                      "bf16_optimizer_states", "autoep_size",
                                                      "x"]), inner, max_size=3)), max_leaves=6)


@st.composite
def _jobs(draw: st.DrawFn) -> dict[str, Any]:
    model: dict[str, Any] = {"preset": draw(st.sampled_from(["tiny-llama", "tiny-mixtral", "tiny-gpt2"]))}
    for key, values in (("layers", st.integers(1, 9)), ("heads", st.integers(1, 9)),
                        ("kv_heads", st.integers(1, 9)), ("hidden", st.sampled_from([32, 48, 64, 96])),
                        ("vocab", st.integers(8, 300)), ("seq_len", st.integers(1, 130)),
                        ("ffn_hidden", st.integers(8, 200))):
        if draw(st.booleans()):
            model[key] = draw(values)
    parallel = {k: draw(_deg) for k in ("tp", "pp", "dp", "cp", "ep") if draw(st.booleans())}
    parallel["zero"] = draw(st.sampled_from([0, 1, 2, 3, "auto"]))
    parallel["sequence_parallel"] = draw(st.booleans())
    parallel["context_parallel"] = {"kind": draw(st.sampled_from(["ring", "ulysses"]))}
    parallel["pipeline"] = {"schedule": draw(st.sampled_from(["gpipe", "1f1b", "interleaved"])),
                            "virtual_stages": draw(st.integers(1, 3)),
                            "partition": draw(st.one_of(st.sampled_from(["parameters", "uniform"]),
                                                        st.lists(st.integers(1, 4), min_size=1, max_size=4)))}
    parallel["order"] = draw(st.sampled_from(["tp-cp-ep-dp-pp", "tp-pp-dp", "dp-tp-cp-ep-pp",
                                              "pp-cp-ep-dp-tp"]))
    training = {"global_batch": draw(st.integers(1, 64)), "micro_batch": draw(st.integers(1, 8)),
                "precision": draw(st.sampled_from(["bf16", "fp16", "fp32"])),
                "optimizer": {"name": draw(st.sampled_from(["adamw", "sgd", "lamb"])),
                              "offload": draw(st.sampled_from(["none", "cpu", "nvme"]))},
                "steps": draw(st.integers(1, 50)), "scheduler": {"warmup_steps": draw(st.integers(0, 60))}}
    hardware = {"preset": draw(st.sampled_from(["cpu-local", "dgx-h100", "dgx-1-v100"])),
                "nodes": draw(st.integers(1, 3)), "gpus_per_node": draw(st.integers(1, 8))}
    deepspeed = draw(st.dictionaries(st.sampled_from(["zero_optimization", "bf16", "fp16", "tensor_parallel",
                                                      "expert_parallel", "compile", "pipeline",
                                                      "managed_gradient_accumulation", "train_batch_size",
                                                      "gradient_allreduce_op", "communication_data_type",
                                                      "sequence_parallel_size", "elasticity", "typo_key"]),
                                     _ds_value, max_size=4))
    return {"version": 1, "model": model, "hardware": hardware, "parallel": parallel, "training": training,
            "deepspeed": deepspeed}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_jobs())
def test_rules_never_crash_and_always_explain(data: dict[str, Any]) -> None:
    spec, diags = parse_job(data, SourceMap("job.yaml"))
    if spec is None:
        assert all(d.rule.startswith("DSF0") for d in diags)
        return
    found = run_rules(Context(spec, build_plan(spec), SourceMap("job.yaml"), data))
    assert not [d.message for d in found if d.rule == "DSF900"]
    assert all(d.message and d.fix and d.path for d in found)


def test_finding_defaults() -> None:
    f = Finding("m", "f")
    assert f.path == () and f.severity is None and not f.at_key
