"""`auto` resolved by the layout search in validate, explain, compile and `dsforge search` (text, JSON,
--write, --plot, --compare), on tiny jobs of this machine's CPU processes and small GPU jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.commands.compile import compile_file
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.search.engine import search
from dsforge.compiler.search.space import AUTO_KEYS, value_at
from dsforge.compiler.search.write import rewrite_text
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity

BASE = """# a tiny job whose layout the search chooses
version: 1
name: tiny-search
model:
  preset: tiny-llama   # 4 layers
  layers: 4
hardware:
  preset: cpu-local
  gpus_per_node: 4
parallel:
  tp: TP
  pp: PP
  cp: CP
  zero: ZERO
  sequence_parallel: SP
  context_parallel: {kind: KIND}
  pipeline: {schedule: SCHED, virtual_stages: VS, partition: uniform}
training:
  global_batch: 8
  micro_batch: MB
  recompute: RC
  precision: fp32
  steps: 10
"""
FIXED = {"TP": "1", "PP": "1", "CP": "1", "ZERO": "1", "SP": "false", "KIND": "ring", "SCHED": "1f1b",
         "VS": "1", "MB": "1", "RC": "none"}
#: The placeholder of each key the search resolves.
KEYS = {("parallel", "tp"): "TP", ("parallel", "pp"): "PP", ("parallel", "cp"): "CP",
        ("parallel", "zero"): "ZERO", ("parallel", "sequence_parallel"): "SP",
        ("parallel", "context_parallel", "kind"): "KIND", ("parallel", "pipeline", "schedule"): "SCHED",
        ("parallel", "pipeline", "virtual_stages"): "VS", ("training", "micro_batch"): "MB",
        ("training", "recompute"): "RC"}


def job_text(auto: set[str], extra: dict[str, str] | None = None) -> str:
    """BASE with the placeholders in ``auto`` set to `auto` and the others to FIXED (or ``extra``)."""
    text = BASE
    for key, value in {**FIXED, **(extra or {})}.items():
        text = text.replace(f": {key}", f": {'auto' if key in auto else value}")
    return text


@pytest.mark.parametrize("key", sorted(KEYS, key=str), ids=lambda k: ".".join(k))
def test_each_auto_field_resolves_in_validate_explain_and_compile(write_job, tmp_path: Path, key) -> None:
    # the fields a choice of its own needs (cp for the CP kind, tp for SP, pp for the schedule) stay auto with
    # it
    with_it = {KEYS[key]} | {"KIND": {"CP"}, "SP": {"TP"}, "SCHED": {"PP"},
                             "VS": {"PP", "SCHED"}}.get(KEYS[key], set())
    path = write_job(job_text(with_it))
    result = validate_file(path)
    assert result.plan is not None and result.search is not None and result.search.winner is not None
    assert not [d for d in result.diagnostics if d.severity is Severity.ERROR], result.diagnostics
    (note,) = [d for d in result.diagnostics if d.rule == "DSF133"]
    assert "the search chose" in note.message and ".".join(key) in note.message
    chosen = value_at(result.plan.spec, key)
    assert chosen != "auto" and chosen == value_at(result.search.winner.spec, key)
    explained = CliRunner().invoke(cli, ["explain", str(path)])
    assert explained.exit_code == 0, explained.output
    out = tmp_path / "out"
    compiled = compile_file(path, out, rewrite=False)
    assert compiled.written is not None, compiled.diagnostics
    plan = json.loads((out / "plan.json").read_text())
    assert plan["search"]["winner"]["layout"] == result.search.winner.layout.as_dict()
    assert plan["search"]["auto"] == [".".join(k) for k in result.search.keys]
    assert value_at_doc(plan["job"], key) == chosen


def value_at_doc(doc: dict, key: tuple[str, ...]):
    for part in key:
        doc = doc[part]
    return doc


def test_a_job_without_auto_has_no_search_in_plan_json(write_job, tmp_path: Path) -> None:
    compiled = compile_file(write_job(job_text(set())), tmp_path / "out", rewrite=False)
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert compiled.written is not None and "search" not in plan and plan["job"]["search"] is None


def test_search_prints_the_table_the_funnel_and_the_fragment(write_job) -> None:
    path = write_job(job_text({"TP", "PP", "ZERO", "MB", "RC"}))
    result = CliRunner().invoke(cli, ["search", str(path), "--top", "3"])
    assert result.exit_code == 0, result.output
    out = result.output
    for header in ("tp", "pp", "zero", "mb", "recompute", "peak memory", "step", "tokens/s", "MFU", "bubble",
                   "exposed comm", "time to train"):
        assert header in out
    assert "funnel:" in out and "legal by construction" in out and "winner (job-file fragment):" in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    fragment = out.split("winner (job-file fragment):\n", 1)[1]
    assert set(yaml.safe_load(fragment)) == {"parallel", "training"}


def test_search_json_carries_the_ranking_and_the_funnel(write_job) -> None:
    path = write_job(job_text({"TP", "ZERO"}))
    result = CliRunner().invoke(cli, ["search", str(path), "--format", "json"])
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["objective"]["name"] == "throughput" and doc["winner"]["layout"] == doc["ranked"][0]["layout"]
    assert [r["value"] for r in doc["ranked"]] == sorted(r["value"] for r in doc["ranked"])
    f = doc["funnel"]
    assert f["considered"] == sum(f["removed"].values()) + f["pruned"] + f["fitting"]


def test_write_keeps_comments_and_key_order_and_validates_clean(write_job, tmp_path: Path) -> None:
    path = write_job(job_text({"TP", "PP", "ZERO", "MB", "RC"}))
    target = tmp_path / "chosen.yaml"
    result = CliRunner().invoke(cli, ["search", str(path), "--write", str(target)])
    assert result.exit_code == 0, result.output
    before, after = path.read_text().splitlines(), target.read_text().splitlines()
    assert len(before) == len(after) and "auto" not in target.read_text()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(changed) == 5 and all(a.split(":")[0] == b.split(":")[0] for a, b in changed)
    assert after[0] == "# a tiny job whose layout the search chooses" and "# 4 layers" in after[4]
    checked = validate_file(target)
    assert not checked.diagnostics and checked.search is None


def test_compare_ranks_the_written_layout_among_all(write_job) -> None:
    path = write_job(job_text(set(), {"TP": "2", "PP": "2", "MB": "2"}))
    result = CliRunner().invoke(cli, ["search", str(path), "--compare", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    rank = doc["written"]["rank"]
    # every field the search sets is searched, the GPU count excepted, and the document says so
    assert {"parallel.tp", "parallel.zero", "parallel.pipeline.schedule", "training.micro_batch",
            "training.recompute"} <= set(doc["auto"]) and "hardware.nodes" not in doc["auto"]
    assert rank >= 1 and doc["winner"]["value"] <= doc["written"]["value"]
    assert sum(1 for r in doc["ranked"] if r["value"] < doc["written"]["value"]) == min(
        rank - 1, len(doc["ranked"])
    )
    from dsforge.commands.search import all_auto
    from dsforge.compiler.search.space import written_layout
    from dsforge.explain.search_report import render

    job, _ = load_job(path)
    assert job is not None
    again = search(job, compare=written_layout(job.spec), spec=all_auto(job.spec))
    assert again.written_rank == rank and f"written (#{rank})" in render(again, "tiny-search")


def test_no_fitting_layout_names_the_closest_misses(write_job) -> None:
    text = job_text({"TP", "PP", "ZERO"}).replace("gpus_per_node: 4",
                                                  "gpus_per_node: 4\n  accelerator: {memory_gb: 0.02}")
    result = CliRunner().invoke(cli, ["search", str(write_job(text))])
    assert result.exit_code == 1
    assert "DSF130" in result.output and "closest misses:" in result.output and "DSF301" in result.output


def test_plot_draws_every_fitting_candidate_and_the_frontier(write_job, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dsforge.explain.search_report import frontier

    path = write_job(job_text({"TP", "ZERO"}))
    result = CliRunner().invoke(cli, ["search", str(path), "--plot", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "search.png").stat().st_size > 1000 and (
        tmp_path / "plots" / "search.svg"
    ).exists()
    assert frontier([(1, 5), (2, 4), (3, 9), (0.5, 1)]) == [3, 0, 2]


def test_nodes_auto_finds_the_fewest_nodes(write_job) -> None:
    text = """version: 1
model: {preset: tiny-llama}
hardware: {preset: cpu-local, gpus_per_node: 2, nodes: auto}
parallel: {tp: auto, zero: auto}
training: {global_batch: 8, precision: fp32, steps: 10}
search: {objective: min_gpus, tokens: 2.0e7, deadline_hours: DEADLINE, max_nodes: 4}
"""
    fast = search(load_job(write_job(text.replace("DEADLINE", "1000")))[0])
    assert fast.nodes == 1
    one_node = fast.winner.step.step_s * 2.0e7 / fast.winner.step.tokens
    tight = search(load_job(write_job(text.replace("DEADLINE", f"{one_node / 3600 * 0.9:.6f}")))[0])
    assert tight.winner is None or tight.nodes > 1


_small = st.fixed_dictionaries({k: st.booleans() for k in ("TP", "PP", "ZERO", "MB", "RC", "SP")})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=_small)
def test_every_ranked_candidate_written_out_validates_clean(write_job, which: dict[str, bool]) -> None:
    auto = {k for k, v in which.items() if v} or {"TP"}
    path = write_job(job_text(auto))
    job, _ = load_job(path)
    assert job is not None
    result = search(job, top=50)
    assert result.ranked
    for e in result.ranked:
        text = rewrite_text(path.read_text(), job, e.layout)
        out = write_job(text, "written.yaml")
        checked = validate_file(out)
        assert not [d for d in checked.diagnostics if d.severity is Severity.ERROR], (
            e.layout,
            checked.diagnostics,
        )
        assert checked.plan is not None and checked.plan.spec.parallel.tp == e.layout.tp


def test_auto_keys_cover_the_issue_list() -> None:
    assert {".".join(k) for k in AUTO_KEYS} == {
        "parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp", "parallel.ep", "parallel.zero",
        "parallel.sequence_parallel", "parallel.context_parallel.kind", "parallel.pipeline.schedule",
        "parallel.pipeline.virtual_stages", "training.micro_batch", "training.recompute", "hardware.nodes"}


def test_a_global_batch_range_is_searched_and_written(write_job, tmp_path: Path) -> None:
    text = job_text({"TP", "MB"}) + "search: {global_batch: [4, 16]}\n"
    path = write_job(text)
    job, _ = load_job(path)
    assert job is not None
    r = search(job, exhaustive=True)
    assert {e.layout.global_batch for e in r.fitting} == {4, 8, 16}
    best = r.winner
    # more tokens per step, at least as fast per token
    assert best is not None and best.layout.global_batch == 16
    target = tmp_path / "chosen.yaml"
    assert CliRunner().invoke(cli, ["search", str(path), "--write", str(target)]).exit_code == 0
    written = validate_file(target)
    assert written.plan is not None and written.plan.spec.training.global_batch == best.layout.global_batch


#: Where each `auto` of the extends test lives: the section, its key path below it, the job-file spelling.
_EXT_KEYS = {"tp": ("parallel", ("tp",)), "pp": ("parallel", ("pp",)), "zero": ("parallel", ("zero",)),
             "schedule": ("parallel", ("pipeline", "schedule")), "mb": ("training", ("micro_batch",)),
             "rc": ("training", ("recompute",))}


def _section(name: str, keys: list[tuple[str, ...]], fixed: dict[str, str], style: str) -> str:
    """One section of the job file in block or flow style, its ``keys`` `auto`."""
    tree: dict = {}
    for path in keys:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = "auto"
    tree.update(fixed)

    def flow(v) -> str:
        return "{" + ", ".join(f"{k}: {flow(x)}" for k,
                               x in v.items()) + "}" if isinstance(v, dict) else str(v)

    def block(v: dict, indent: int) -> str:
        return "".join(f"{' ' * indent}{k}:\n{block(x, indent + 2)}" if isinstance(x, dict)
                       else f"{' ' * indent}{k}: {x}   # {k}\n" for k, x in v.items())

    return f"{name}: {flow(tree)}\n" if style == "flow" else f"{name}:\n  # the {name}\n{block(tree, 2)}"


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(where=dict.fromkeys(_EXT_KEYS, "base"), styles={"parallel": "block", "training": "absent"})
@example(where={"tp": "job", "pp": "base", "zero": "job", "schedule": "base", "mb": "job", "rc": "base"},
         styles={"parallel": "flow", "training": "block"})
@given(where=st.fixed_dictionaries({k: st.sampled_from(["base", "job"]) for k in _EXT_KEYS}),
       styles=st.fixed_dictionaries({s: st.sampled_from(["block", "flow",
                                                         "absent"]) for s in ("parallel", "training")}))
def test_an_auto_from_an_extended_file_is_written_into_the_job_file(write_job, where, styles) -> None:
    """--write sets an `auto` that a file named in `extends:` writes as an override in the job file (comments,
    order and style of the job file kept, the extended file untouched); every ranked candidate written so
    validates clean and plans exactly the candidate's values."""
    placed = {k: ("base" if styles[_EXT_KEYS[k][0]] == "absent" else w) for k, w in where.items()}
    per = {(sec, at): [p for k, (s, p) in _EXT_KEYS.items() if s == sec and placed[k] == at]
           for sec in ("parallel", "training") for at in ("base", "job")}
    base = ("version: 1\nmodel: {preset: tiny-llama}\nhardware: {preset: cpu-local, gpus_per_node: 4}\n"
            + _section("parallel", per[("parallel", "base")], {"cp": "1"}, "block")
            + _section("training", per[("training", "base")],
                       {"global_batch": "8", "precision": "fp32", "steps": "10"}, "flow"))
    write_job(base, "base.yaml")
    text = "# the job\nextends: base.yaml\nname: child   # its name\n"
    for sec, fixed in (("parallel", {"ep": "1"}), ("training", {"seed": "7"})):
        if styles[sec] != "absent":
            text += _section(sec, per[(sec, "job")], fixed, styles[sec])
    path = write_job(text)
    job, diags = load_job(path)
    assert job is not None, diags
    result = search(job, top=5)
    assert result.ranked
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    for e in result.ranked:
        out = write_job(rewrite_text(text, job, e.layout), "written.yaml")
        written = out.read_text()
        # kept, in order
        assert [line.split("#", 1)[1] for line in written.splitlines() if "#" in line] == comments
        assert written.startswith(text.splitlines()[0]) and (out.parent / "base.yaml").read_text() == base
        checked = validate_file(out)
        assert not [d for d in checked.diagnostics if d.severity is Severity.ERROR], (
            written,
            checked.diagnostics,
        )
        assert checked.plan is not None and checked.search is None, written  # nothing left `auto`
        for path_key, attr in (("parallel", "tp"), ("parallel", "pp"), ("parallel", "zero")):
            assert value_at(checked.plan.spec, (path_key, attr)) == getattr(e.layout, attr)
        spec = checked.plan.spec
        assert (spec.parallel.pipeline.schedule, spec.training.micro_batch, spec.training.recompute) == (
            e.layout.schedule, e.layout.micro_batch, e.layout.recompute)
