"""Hostile inputs cost bounded time and memory and end in a diagnostic (issue 13, items 1-2).

What cannot be a fixture file of the bad corpus lives here: a FIFO, /dev/zero, a 3 GB sparse file,
a directory; jobs that are valid but enormous (2^40 sequences per step, 2^20 ranks); the JSON
writers' refusal of NaN and Infinity; the bounds of the schema at their edges.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.compiler.emit.ds_config import EmitError
from dsforge.compiler.emit.render import canonical_json
from dsforge.compiler.frontend.source import MAX_FILE_BYTES, MAX_NUMBER_DIGITS, load_yaml, read_text
from dsforge.compiler.spec import schema
from dsforge.compiler.strict_json import NonFiniteError, dumps, finite_or_text, non_finite
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Diagnostic, InputError, Location, Severity
from dsforge.formatters import get
from tests.conftest import ROOT

JOB = """\
version: 1
name: hostile
model:
  preset: tiny-llama
hardware:
  preset: cpu-local
  gpus_per_node: 4
parallel:
  pp: 2
  zero: 1
  pipeline: {schedule: 1f1b, partition: uniform}
training:
  global_batch: 8
  precision: fp32
  steps: 20
"""


def _rules(path: Path) -> list[tuple[str, int]]:
    return [(d.rule, d.location.line) for d in validate_file(path).diagnostics]


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


# --- only regular files are read ----------------------------------------------------------------------------

def _validate_in_a_subprocess(path: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`dsforge validate` in its own process: a regression here would hang, and the timeout turns it into a
    failure."""
    return subprocess.run([sys.executable, "-m", "dsforge", "validate", path], check=False,
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "job.yaml")
    done = _validate_in_a_subprocess("job.yaml", tmp_path)
    assert done.returncode == 2 and "DSF001" in done.stdout and "FIFO" in done.stdout, (
        done.stdout + done.stderr
    )
    (tmp_path / "child.yaml").write_text("extends: job.yaml\n" + JOB, encoding="utf-8")
    done = _validate_in_a_subprocess("child.yaml", tmp_path)
    assert done.returncode == 2 and "child.yaml:1:10: error[DSF010]" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero on this platform")
def test_dev_zero_is_refused_without_reading_it(tmp_path: Path) -> None:
    done = _validate_in_a_subprocess("/dev/zero", tmp_path)
    assert done.returncode == 2 and "DSF001" in done.stdout and "character device" in done.stdout
    (tmp_path / "child.yaml").write_text("extends: /dev/zero\n" + JOB, encoding="utf-8")
    assert _rules(tmp_path / "child.yaml") == [("DSF010", 1)]


def test_a_huge_sparse_file_is_refused_from_its_size(tmp_path: Path) -> None:
    path = tmp_path / "sparse.yaml"
    with open(path, "wb") as fh:
        fh.truncate(3 * 1024**3)  # 3 GB of holes: reading it would take seconds and 3 GB of memory
    began = time.process_time()  # CPU seconds, which the machine's load does not inflate as it does wall time
    with pytest.raises(InputError) as err:
        read_text(path, "sparse.yaml")
    assert time.process_time() - began < 1.0
    [diag] = err.value.diagnostics
    assert diag.rule == "DSF007" and str(3 * 1024**3) in diag.message


def test_a_directory_and_a_nul_in_the_path_are_dsf001(tmp_path: Path) -> None:
    for path in (tmp_path, Path(f"{tmp_path}/a\x00b.yaml")):
        with pytest.raises(InputError) as err:
            read_text(path, "x")
        assert err.value.diagnostics[0].rule == "DSF001"


def test_a_file_at_the_size_limit_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    body = JOB.encode()
    path.write_bytes(body + b"#" * (MAX_FILE_BYTES - len(body)))
    assert read_text(path, "job.yaml").startswith("version: 1")
    path.write_bytes(body + b"#" * (MAX_FILE_BYTES - len(body) + 1))
    with pytest.raises(InputError) as err:
        read_text(path, "job.yaml")
    assert err.value.diagnostics[0].rule == "DSF007"


# --- the loader: every scalar is a value or a diagnostic ---------------------------------------------------

TAGS = ["!!int", "!!float", "!!bool", "!!null", "!!str", "!!timestamp", "!!binary", "!!set", "!!merge"]


@settings(max_examples=200, deadline=None)
@given(tag=st.sampled_from(TAGS), value=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                                                max_size=12))
def test_a_tagged_scalar_is_a_value_or_dsf006(tag: str, value: str) -> None:
    text = f"version: 1\nsteps: {tag} {json.dumps(value)}\n"
    try:
        data, _ = load_yaml(text, "job.yaml")
    except InputError as exc:
        assert {d.rule for d in exc.diagnostics} <= {"DSF004", "DSF006"}
        assert all(d.location.line >= 1 for d in exc.diagnostics)
    else:
        assert "steps" in data


@pytest.mark.parametrize("digits,rule", [(MAX_NUMBER_DIGITS, None), (MAX_NUMBER_DIGITS + 1, "DSF007"),
                                         (4301, "DSF007"), (100_000, "DSF007")])
def test_integer_literals_longer_than_the_limit_are_dsf007(digits: int, rule: str | None) -> None:
    text = f"version: 1\nseed: {'7' * digits}\n"
    if rule is None:
        data, _ = load_yaml(text, "job.yaml")
        assert len(str(data["seed"])) == digits
        return
    with pytest.raises(InputError) as err:
        load_yaml(text, "job.yaml")
    assert [(d.rule, d.location.line) for d in err.value.diagnostics] == [(rule, 2)]


def test_a_number_at_the_digit_limit_reports_a_range_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("steps: 20", "steps: " + "9" * MAX_NUMBER_DIGITS), encoding="utf-8")
    [diag] = validate_file(path).diagnostics
    assert (diag.rule, diag.location.line) == ("DSF022", 15)


# --- bounded work on valid but enormous jobs ---------------------------------------------------------------

def _timed(*args: str) -> tuple[int, str, float]:
    began = time.process_time()
    code, out, _ = _cli(*args)
    return code, out, time.process_time() - began


def test_a_step_of_2_to_the_40_sequences_explains_and_compiles_in_well_under_a_second(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("global_batch: 8", f"global_batch: {2**40}"), encoding="utf-8")
    assert _cli("validate", str(path))[0] == 0
    code, out, spent = _timed("explain", str(path), "--format", "json")
    assert code == 0 and spent < 1.0, spent
    summary = _strict(out)
    assert isinstance(summary, dict) and summary["layout"]["micro_batches"] == 2**40 // 2
    code, _, spent = _timed("compile", str(path), "-o", str(tmp_path / "out"), "--no-rewrite")
    assert code == 0 and spent < 1.5, spent


def test_a_world_of_2_to_the_20_ranks_validates_explains_and_compiles_quickly(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    big = JOB.replace("  gpus_per_node: 4", f"  gpus_per_node: 8\n  nodes: {2**17}")
    big = big.replace("global_batch: 8", f"global_batch: {2**21}") + "launch: {launcher: slurm}\n"
    path.write_text(big, encoding="utf-8")
    for args in (("validate", str(path)), ("explain", str(path), "--format", "json"),
                 ("compile", str(path), "-o", str(tmp_path / "out"), "--no-rewrite")):
        code, _, spent = _timed(*args)
        assert code == 0 and spent < 2.0, (args[0], spent)
    plan = _strict((tmp_path / "out" / "plan.json").read_text(encoding="utf-8"))
    assert isinstance(plan, dict) and plan["world_size"] == 2**20
    dp = plan["placement"]["groups_summary"]["dp"]
    assert (dp["count"], dp["size"], len(dp["first"])) == (2, 2**19, 64)
    assert (tmp_path / "out" / "plan.json").stat().st_size < 100_000


def test_one_more_node_than_the_world_bound_is_dsf022(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("  gpus_per_node: 4", f"  gpus_per_node: 8\n  nodes: {2**17 + 1}"),
                    encoding="utf-8")
    [diag] = [d for d in validate_file(path).diagnostics if d.rule == "DSF022"]
    assert diag.path == ("hardware", "nodes") and "131072" in diag.message


BOUNDS = [(("model", "layers"), schema.MAX_LAYERS), (("model", "hidden"), schema.MAX_HIDDEN),
          (("model", "heads"), schema.MAX_HEADS), (("model", "vocab"), schema.MAX_VOCAB),
          (("model", "seq_len"), schema.MAX_SEQ_LEN),
          (("hardware", "gpus_per_node"), schema.MAX_GPUS_PER_NODE),
          (("training", "global_batch"), schema.MAX_BATCH), (("training", "steps"), schema.MAX_STEPS),
          (("parallel", "pp"), schema.MAX_STAGES), (("parallel", "tp"), schema.MAX_WORLD)]


@pytest.mark.parametrize("path,bound", BOUNDS, ids=[".".join(p) for p, _ in BOUNDS])
def test_each_size_has_its_bound_and_the_bound_is_far_above_every_preset(
    tmp_path: Path, path: tuple[str, str], bound: int
) -> None:
    from dsforge.compiler.frontend.presets import presets

    data = yaml.safe_load(JOB)
    data.setdefault(path[0], {})[path[1]] = bound + 1
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data), encoding="utf-8")
    found = [d for d in validate_file(job).diagnostics if d.rule == "DSF022"]
    assert [d.path for d in found] == [path], found
    kind = {"model": "models", "hardware": "hardware"}.get(path[0])
    if kind:  # every preset lies at least 8x below the bound
        values = [p.spec[path[1]] for p in presets(kind).values() if isinstance(p.spec.get(path[1]), int)]
        assert values and max(values) * 8 <= bound


# --- no NaN or Infinity in any JSON output ------------------------------------------------------------------

def test_strict_dumps_names_the_first_non_finite_number() -> None:
    assert non_finite({"a": [1.0, {"b": math.inf}]}) == ("a.1.b", math.inf)
    with pytest.raises(NonFiniteError) as err:
        dumps({"time": {"step_s": math.nan}})
    assert err.value.path == "time.step_s"
    assert finite_or_text({"x": [math.nan, -math.inf, 2.0]}) == {"x": ["nan", "-inf", 2.0]}
    with pytest.raises(EmitError, match="step_s"):
        canonical_json({"summary": {"step_s": math.inf}})


def test_json_and_sarif_reports_quote_a_non_finite_value_as_text() -> None:
    diag = Diagnostic("DSF516", Severity.ERROR, "`deepspeed.x` is nan", Location("job.yaml", 3, 4), "fix it",
                      ("deepspeed", "x"), details={"value": math.nan})
    for fmt in ("json", "sarif"):
        _strict(get(fmt)([diag]))


@pytest.mark.parametrize("override", ["{steps_per_print: .nan}", "{gradient_clipping: .inf}",
                                      "{zero_optimization: {reduce_bucket_size: -.inf}}", "{x: [1, .nan]}",
                                      "{train_batch_size: 1.0e+400}"])
def test_a_non_finite_override_is_dsf516_at_its_line(tmp_path: Path, override: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB + f"deepspeed: {override}\n", encoding="utf-8")
    assert ("DSF516", 16) in _rules(path)
    code, out, _ = _cli("validate", str(path), "--format", "json")
    assert code == 1 and _strict(out)
    code, _, _ = _cli("compile", str(path), "-o", str(tmp_path / "out"), "--no-rewrite")
    assert code == 1 and not (tmp_path / "out").exists()


def test_a_non_finite_summary_costs_plan_json_its_summary_not_the_job(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.compiler.estimate import summary

    real = summary.summarize

    def broken(plan):
        out = real(plan)
        out["time"]["step_s"] = math.inf
        return out

    monkeypatch.setattr(summary, "summarize", broken)
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    code, out, _ = _cli("compile", str(path), "-o", str(tmp_path / "out"), "--no-rewrite")
    assert code == 0 and "DSF690" in out and "summary.time.step_s" in out
    plan = _strict((tmp_path / "out" / "plan.json").read_text(encoding="utf-8"))
    assert isinstance(plan, dict) and "summary" not in plan


@pytest.mark.parametrize("tokens", ["nan", "inf", "-inf", "1e31", "0.5"])
def test_explain_tokens_must_be_a_finite_count(tmp_path: Path, tokens: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    result = CliRunner().invoke(cli, ["explain", str(path), "--tokens", tokens])
    assert result.exit_code == 2 and "--tokens" in result.stderr
    assert _cli("explain", str(path), "--tokens", "1e12", "--format", "json")[0] == 0


def test_an_fp32_job_without_an_fp32_peak_is_dsf503_not_an_explain_failure(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("  gpus_per_node: 4", "  gpus_per_node: 4\n  accelerator: {fp32_tflops: 0}"),
                    encoding="utf-8")
    assert ("DSF503", 15) in _rules(path)


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
@pytest.mark.parametrize("extra", ["", ("  pipeline: {schedule: interleaved, "
                                        "virtual_stages: 9, partition: uniform}\n")],
                         ids=["1f1b", "interleaved-9-chunks"])
def test_the_deepest_pipeline_the_schema_allows_costs_bounded_time(tmp_path: Path, extra: str) -> None:
    path = tmp_path / "job.yaml"
    job = JOB.replace("  preset: tiny-llama", "  preset: tiny-llama\n  layers: 9216")
    job = job.replace("  gpus_per_node: 4",
                      "  gpus_per_node: 1024").replace("  pp: 2", f"  pp: {schema.MAX_STAGES}")
    job = job.replace("  pipeline: {schedule: 1f1b, partition: uniform}\n",
                      extra or "  pipeline: {partition: uniform}\n")
    if "interleaved" in extra:  # dsforge's own runtime runs one chunk per stage (DSF142); Megatron
                                # interleaves
        job = "stack: megatron-te\n" + job
    path.write_text(job.replace("global_batch: 8", f"global_batch: {2**20}"), encoding="utf-8")
    for args in (("validate", str(path)), ("explain", str(path), "--format", "json"),
                 ("compile", str(path), "-o", str(tmp_path / "out"), "--no-rewrite")):
        code, _, spent = _timed(*args)
        assert code == 0 and spent < 2.0, (args[0], spent)
    code, out, _ = _cli("explain", str(path))
    # the step time of a pipeline this deep is the pace estimate, and explain says so; equal stages print once
    assert code == 0 and "it is not exact" in out and ("extrapolates the slowest rank's "
                                                       "pace") in out, out[:3000]
    assert "(stages 1-1022)" in out and out.count("332.93k") == 1, out[:3000]
    assert _strict(_cli("explain", str(path), "--format", "json")[1])["pipeline"]["timeline_exact"] is False  # type: ignore[index]


def test_explain_does_not_call_a_simulated_step_time_an_estimate(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    code, out, _ = _cli("explain", str(path))
    assert code == 0 and "it is not exact" not in out
    assert _strict(_cli("explain", str(path), "--format", "json")[1])["pipeline"]["timeline_exact"] is True  # type: ignore[index]
