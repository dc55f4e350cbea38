"""The search asks a check once per class of candidates that agree on the layout fields the check declares it
reads (`Rule.reads`, `engine.rule_tier`): each declaration is tested here on whole small spaces (one verdict
per class), a wrong one is caught, and the search that asks per class ranks as the one that asks every
candidate."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.rules.registry import Context, Rule, checks, run_rules
from dsforge.compiler.search.engine import GROUP_FIELDS, rule_tier, search
from dsforge.diagnostics import Severity
from tests.search_candidates import candidates

#: Spaces where the declared checks refuse some classes and pass others: context with pipeline parallelism
#: (DSF140), interleaved chunks (DSF142), ZeRO-2 written with pipelines (DSF501), replicated KV heads (DSF143,
#: DSF104), ZeRO-3 with experts (DSF502), a multi-node job on the local launcher (DSF609), Megatron's even
#: split (DSF109), Ulysses heads (DSF112), the sequence over cp and tp (DSF111, DSF123).
SPACES = {
    "dense-3d": """version: 1
model: {preset: tiny-llama, layers: 8, seq_len: 48}
hardware: {preset: cpu-local, gpus_per_node: 8}
parallel: {tp: auto, pp: auto, cp: auto, zero: 2, sequence_parallel: auto, context_parallel: {kind: auto},
           replicate_kv_heads: true, pipeline: {schedule: auto, virtual_stages: auto, partition: uniform}}
training: {global_batch: 8, micro_batch: auto, recompute: auto, precision: fp32, steps: 10}
""",
    "moe": """version: 1
model: {preset: tiny-mixtral}
hardware: {preset: cpu-local, gpus_per_node: 8}
parallel: {tp: auto, pp: auto, cp: auto, ep: auto, zero: auto, context_parallel: {kind: auto}}
training: {global_batch: 8, micro_batch: auto, precision: fp32, steps: 10}
""",
    "megatron-two-nodes": """version: 1
stack: megatron-te
model: {preset: tiny-llama, layers: 6, heads: 8, kv_heads: 8, seq_len: 24}
hardware: {preset: cpu-local, gpus_per_node: 4, nodes: 2}
parallel: {tp: auto, pp: auto, cp: auto, zero: auto, sequence_parallel: true, context_parallel: {kind: auto}}
training: {global_batch: 8, micro_batch: auto, precision: fp32, steps: 10}
""",
}


def _declared() -> list[Rule]:
    return [r for r in checks("validate") if r.reads is not None]


def _split_verdicts(write_job, rules: list[Rule]) -> tuple[list[str], int, set[str]]:
    """(the classes with more than one verdict, classes checked, the ids that refuse a class) of ``rules``
    over SPACES."""
    verdicts: dict[tuple, set[bool]] = defaultdict(set)
    for name, text in SPACES.items():
        for job, lay, plan in candidates(write_job, text):
            ctx = Context(plan.spec, plan, job.source, job.raw)
            for r in rules:
                refused = any(d.severity is Severity.ERROR for d in run_rules(ctx, [r]))
                key = (name, r.id, lay.nodes, *(getattr(lay, f) for f in r.reads or ()))
                verdicts[key].add(refused)
    split = [f"{k}: {v}" for k, v in verdicts.items() if len(v) > 1]
    return split, len(verdicts), {k[1] for k, v in verdicts.items() if v == {True}}


def test_every_declared_check_gives_one_verdict_per_class(write_job) -> None:
    rules = _declared()
    assert {"DSF140", "DSF142", "DSF501", "DSF502", "DSF609", "DSF103"} <= {r.id for r in rules}
    split, classes, refused = _split_verdicts(write_job, rules)
    assert not split, split[:5]
    assert classes > 200 and {"DSF140", "DSF142", "DSF143", "DSF501", "DSF502", "DSF609",
                              "DSF109"} <= refused, refused
    # every check the search asks early has declared only fields that a skeleton or a memory group fixes; one
    # that reads the micro-batch, or names no search field, is asked per candidate
    assert all(set(r.reads or ()) <= GROUP_FIELDS for r in rules if rule_tier(r) is not None)
    import dataclasses

    assert rule_tier(dataclasses.replace(rules[0], reads=("tp", "micro_batch"))) is None
    assert rule_tier(dataclasses.replace(rules[0], reads=("tp", "tpp"))) is None
    assert rule_tier(dataclasses.replace(rules[0], reads=("cp", "pp"))) == "skeleton"
    assert rule_tier(dataclasses.replace(rules[0], reads=("pp", "schedule"))) == "group"


def test_a_declaration_that_omits_a_field_it_reads_is_caught(write_job) -> None:
    import dataclasses

    rules = {r.id: r for r in checks("validate")}
    wrong = [dataclasses.replace(rules["DSF140"], reads=("pp",)),
             dataclasses.replace(rules["DSF142"], reads=("pp",))]
    split, _, _ = _split_verdicts(write_job, wrong)
    assert {s.split(",")[1].strip(" '") for s in split} == {"DSF140", "DSF142"}


@pytest.mark.parametrize("name", sorted(SPACES))
def test_asking_per_class_ranks_as_asking_every_candidate(write_job, name: str) -> None:
    job, _ = load_job(write_job(SPACES[name].replace("nodes: 2", "nodes: 1")))
    assert job is not None
    pruned, full = search(job), search(job, exhaustive=True)  # exhaustive asks every check of every candidate
    top = len(pruned.ranked)
    assert not pruned.exhaustive and top > 0
    assert [(e.layout, e.value) for e in pruned.ranked] == [(e.layout, e.value) for e in full.ranked[:top]]
    f = pruned.funnel
    assert f.considered == full.funnel.considered == sum(f.removed.values()) + f.pruned + f.fitting


_FIELDS = st.fixed_dictionaries({
    "tp": st.sampled_from(["auto", "1", "2"]), "pp": st.sampled_from(["auto", "1", "2"]),
    "cp": st.sampled_from(["auto", "1"]), "zero": st.sampled_from(["auto", "0", "1", "3"]),
    "sp": st.sampled_from(["auto", "false"]), "schedule": st.sampled_from(["auto", "1f1b"]),
    "mb": st.sampled_from(["auto", "1"]), "rc": st.sampled_from(["auto", "selective"]),
    "preset": st.sampled_from(["tiny-llama", "tiny-mixtral"]), "gpus": st.sampled_from([2, 4, 8]),
})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(f=_FIELDS)
def test_the_class_shortcut_ranks_as_the_plain_search_on_drawn_spaces(write_job, f: dict) -> None:
    ep = "auto" if f["preset"] == "tiny-mixtral" else "1"
    text = f"""version: 1
model: {{preset: {f["preset"]}}}
hardware: {{preset: cpu-local, gpus_per_node: {f["gpus"]}}}
parallel: {{tp: {f["tp"]}, pp: {f["pp"]}, cp: {f["cp"]}, ep: {ep}, zero: {f["zero"]},
           sequence_parallel: {f["sp"]}, pipeline: {{schedule: {f["schedule"]}}}}}
training: {{global_batch: 8, micro_batch: {f["mb"]}, recompute: {f["rc"]}, precision: fp32, steps: 10}}
search: {{top: 8}}
"""
    job, diags = load_job(write_job(text))
    assert job is not None, diags
    pruned, full = search(job), search(job, exhaustive=True)
    top = len(pruned.ranked)
    assert [(e.layout, e.value) for e in pruned.ranked] == [(e.layout, e.value) for e in full.ranked[:top]]
    assert top == min(8, len(full.ranked))
