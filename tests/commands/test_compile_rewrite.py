"""`dsforge compile` and the rewrite plan: recorded in plan.json, DSF607 for a model the policies cannot
place, a recorded skip without torch or with --no-rewrite, and the runtime agreeing with the emitted pipeline
keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from dsforge.cli import cli
from dsforge.compiler.emit.ds_config import build_ds_config
from dsforge.compiler.frontend.parse import load_job
from tests.conftest import ROOT
from tests.test_compile_support import example_path, variant_plan

#: The toy non-HF model of the rewrite tests, with rules for only some of its modules.
TOY_JOB: dict[str, Any] = {
    "version": 1, "name": "toy",
    "model": {"arch": "custom", "factory": "tests.runtime_rewrite.toy_models:build", "layers": 2,
              "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 256, "seq_len": 32},
    "hardware": {"preset": "cpu-local", "gpus_per_node": 2},
    "parallel": {"tp": 2, "pp": 1, "dp": 1},
    "training": {"global_batch": 2, "micro_batch": 1},
    "rewrite": [{"match": "tok", "as": "vocab"}, {"match": r"blocks\.\d+\.qkv", "as": "column", "fused": 3},
                {"match": r"blocks\.\d+\.out", "as": "row"}, {"match": r"blocks\.\d+\.fc1", "as": "column"}],
}


def compile_(*args: str) -> Result:
    return CliRunner().invoke(cli, ["compile", *args])


def write_job(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def plan_json(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "plan.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runtime() -> None:
    """These tests build models on the meta device: they need torch and transformers."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def test_plan_json_records_the_rewrite_plan_and_its_exact_counts(tmp_path: Path, runtime: None) -> None:
    doc = yaml.safe_load(example_path("mixtral-8x7b-ep").read_text(encoding="utf-8"))
    doc["parallel"].update(tp=2, ep=4, sequence_parallel=True)  # experts stay whole on each TP rank
    job = write_job(tmp_path, doc)
    for name in ("a", "b"):
        result = compile_(str(job), "-o", str(tmp_path / name))
        assert result.exit_code == 0, result.output
    a, b = (tmp_path / "a" / "plan.json").read_bytes(), (tmp_path / "b" / "plan.json").read_bytes()
    assert a == b  # deterministic, rewrite section included
    doc = plan_json(tmp_path / "a")
    rewrite, params = doc["rewrite"], doc["summary"]["params"]
    assert rewrite["ok"] is True and rewrite["arch"] == "mixtral" and rewrite["tp"] == 2
    assert {row["variant"] for row in rewrite["summary"]} >= {"column", "row", "vocab", "norm", "expert"}
    # Exact counts replace the formula's; the formula keeps experts whole on each TP rank as the runtime
    # does, so per-rank counts agree too.
    assert params["total"] == rewrite["params"]["total"] == rewrite["params"]["formula_total"]
    stage = params["per_gpu_by_stage"][0]
    assert stage["exact"] == rewrite["params"]["per_rank_by_stage"][0] == 12_077_764_608
    assert stage["dense"] + stage["expert"] == stage["exact"] and params["source"] == "rewrite plan (exact)"


def test_a_model_the_policies_cannot_place_is_refused_naming_the_modules_left_over(tmp_path: Path,
                                                                                  runtime: None) -> None:
    result = compile_(str(write_job(tmp_path, TOY_JOB)), "-o", str(tmp_path / "job"))
    assert result.exit_code == 1 and not (tmp_path / "job").exists()
    assert "error[DSF607]" in result.output and "Traceback" not in result.output
    assert "blocks.{0..1}.norm, blocks.{0..1}.fc2, final, head" in result.output
    path = write_job(tmp_path, TOY_JOB)
    as_json = compile_(str(path), "-o", str(tmp_path / "job"), "--format", "json")
    found = [d for d in json.loads(as_json.stdout)["diagnostics"] if d["rule"] == "DSF607"]
    rules_line = path.read_text(encoding="utf-8").splitlines().index("rewrite:") + 1
    assert found[0]["line"] >= rules_line and "rewrite:" in found[0]["fix"]  # at the job's `rewrite:` rules
    assert found[0]["details"]["leftover"] == ["blocks.0.norm", "blocks.0.fc2", "blocks.1.norm",
                                               "blocks.1.fc2", "final", "head"]
    from tests.runtime_rewrite.toy_models import build

    placed = {**TOY_JOB, "rewrite": [*TOY_JOB["rewrite"], {"match": r"blocks\.\d+\.fc2", "as": "row"},
                                     {"match": r"blocks\.\d+\.norm|final", "as": "replicate"},
                                     {"match": "head", "as": "vocab"}]}
    path = write_job(tmp_path, placed)
    done = compile_(str(path), "-o", str(tmp_path / "job"))
    assert done.exit_code == 0, done.output
    job, _ = load_job(path)
    assert job is not None
    exact = plan_json(tmp_path / "job")["rewrite"]["params"]["total"]
    assert exact == sum(p.numel() for p in build(job.spec.model).parameters())


def test_no_rewrite_is_recorded_as_skipped_without_a_note(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["compile", str(example_path("tiny-3d")), "-o", str(tmp_path / "job"),
                                      "--no-rewrite"])
    assert result.exit_code == 0 and "note:" not in result.output
    assert plan_json(tmp_path / "job")["rewrite"] == {"skipped": "compile ran with --no-rewrite"}
    # --no-rewrite skips DSF607 too: the toy model's leftover modules are not looked at
    toy = compile_(str(write_job(tmp_path, TOY_JOB)), "-o", str(tmp_path / "toy"), "--no-rewrite")
    assert toy.exit_code == 0, toy.output


def test_without_torch_the_rewrite_plan_is_a_recorded_skip_and_a_note(tmp_path: Path) -> None:
    out = tmp_path / "job"
    code = ("import sys; sys.modules['torch'] = None; from dsforge.cli import main; "
            f"sys.argv = ['dsforge', 'compile', "
            f"{str(example_path('tiny-3d'))!r}, '-o', {str(out)!r}]; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "note: plan.json has no rewrite plan: torch is not installed here" in proc.stderr
    assert plan_json(out)["rewrite"] == {"skipped": "torch is not installed here (pip install "
                                                    "'dsforge[runtime]')"}


def test_a_factory_that_cannot_be_imported_here_is_a_skip_not_an_error(tmp_path: Path) -> None:
    job = {**TOY_JOB, "model": {**TOY_JOB["model"], "factory": "site_only_package.models:build"}}
    result = compile_(str(write_job(tmp_path, job)), "-o", str(tmp_path / "job"))
    assert result.exit_code == 0, result.output
    assert "cannot be imported here" in plan_json(tmp_path / "job")["rewrite"]["skipped"]


def test_a_crashing_rewrite_planner_costs_only_the_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           runtime: None) -> None:
    from dsforge.runtime import rewrite

    def boom(spec: object, plan: object) -> dict[str, Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(rewrite, "describe", boom)
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "job"))
    assert result.exit_code == 0 and "DSF691" in result.output and "boom" in result.output
    assert plan_json(tmp_path / "job")["rewrite"] == {
        "skipped": "the rewrite planner failed: RuntimeError: boom"
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_runtime_asks_deepspeed_for_the_pipeline_keys_compile_emits(
    tmp_path: Path, sequence_parallel: bool, runtime: None
) -> None:
    from dsforge.runtime.pipeline_stages import ds_pipeline_config
    from dsforge.runtime.rewrite import plan_rewrite

    plan = variant_plan(tmp_path, "tiny-3d", {"parallel": {"sequence_parallel": sequence_parallel}})
    emitted = build_ds_config(plan)["pipeline"]
    wanted = ds_pipeline_config(plan_rewrite(plan.spec.model, plan))
    assert wanted == {key: emitted[key] for key in wanted}
    assert wanted["pipe_partitioned"] is not sequence_parallel
