"""`dsforge run` before it launches anything, and benchmarks/gpu_check.sh without a GPU (both fast).

A job with errors must print them and exit 1 without starting a launcher; a Python without torch
must be told how to install it (exit 2); a second `dsforge run` of the same compile reuses the job
directory (to resume), raising training.steps continues it (files re-written, checkpoints kept), any
other change is refused unless --fresh; gpu_check.sh must say that it needs a GPU and run nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.commands import run as runner

ROOT = Path(__file__).resolve().parents[2]

GOOD = """version: 1
name: cli-run
model: {preset: tiny-gpt2}
hardware: {preset: cpu-local, gpus_per_node: 2}
parallel: {dp: auto, zero: 1}
training: {global_batch: 4, micro_batch: 1, precision: fp32, steps: 2}
"""


def _no_launch(job_dir: Path) -> int:
    raise AssertionError(f"launched {job_dir}")


def test_job_with_errors_is_not_launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "launch", _no_launch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(GOOD.replace("gpus_per_node: 2", "gpus_per_node: 3").replace(
        "zero: 1}", "tp: 2, zero: 1}"))
    result = CliRunner().invoke(cli, ["run", "bad.yaml"])
    assert result.exit_code == 1, result.output
    assert "error[" in result.output and "nothing to run" in result.output
    assert not (tmp_path / "runs" / "cli-run").exists()


def test_missing_runtime_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(runner, "missing_runtime", lambda: ["torch", "deepspeed"])
    (tmp_path / "job.yaml").write_text(GOOD)
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2
    assert "no torch, deepspeed" in result.output and "torch==2.13.0" in result.output


def test_same_compile_is_reused_more_steps_continue_and_other_changes_need_fresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[Path] = []
    monkeypatch.setattr(runner, "launch", lambda d: launched.append(d) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(GOOD)
    first = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert first.exit_code == 0, first.output
    assert "raise training.steps in job.yaml and run `dsforge run job.yaml` again" in first.output
    job_dir = tmp_path / "runs" / "cli-run"
    (job_dir / "checkpoints").mkdir()  # what a run leaves behind
    (job_dir / "checkpoints" / "latest").write_text("step2")
    (job_dir / "train_log.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    again = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert again.exit_code == 0 and "resuming the earlier run" in again.output
    # More steps: the same training, continued. The files are re-written, the checkpoints and the log kept.
    (tmp_path / "job.yaml").write_text(GOOD.replace("steps: 2", "steps: 3"))
    longer = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert longer.exit_code == 0, longer.output
    assert "continuing the earlier run" in longer.output and "training.steps 2 -> 3" in longer.output
    assert "now decays over 3 steps" in longer.output  # the cosine schedule follows the new length
    plan = json.loads((job_dir / "plan.json").read_text())
    assert plan["job"]["training"]["steps"] == 3 and "summary" in plan
    assert json.loads((job_dir / "ds_config.json").read_text())["scheduler"]["params"]["total_num_steps"] == 3
    assert (job_dir / "checkpoints" / "latest").read_text() == "step2"
    assert (job_dir / "train_log.jsonl").read_text().count("step") == 2
    # Anything else changes what the checkpoints mean: refused, naming the key, unless --fresh.
    (tmp_path / "job.yaml").write_text(GOOD.replace("steps: 2", "steps: 3").replace("fp32", "bf16"))
    changed = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert changed.exit_code == 2 and "--fresh" in changed.output
    assert 'training.precision "fp32" -> "bf16"' in changed.output
    fresh = CliRunner().invoke(cli, ["run", "job.yaml", "--fresh"])
    assert fresh.exit_code == 0 and not (job_dir / "checkpoints").exists()
    assert launched == [job_dir] * 4
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".dsforge-run-")]


def test_fresh_refuses_checkpoints_it_would_not_discard(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "launch", lambda d: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step2")
    (tmp_path / "job.yaml").write_text(GOOD.replace("steps: 2}", "steps: 2, checkpoint: {dir: ckpt}}"))
    assert CliRunner().invoke(cli, ["run", "job.yaml"]).exit_code == 0
    result = CliRunner().invoke(cli, ["run", "job.yaml", "--fresh"])
    assert result.exit_code == 2 and f"resumes from the checkpoints in {tmp_path / 'ckpt'}" in result.output
    assert (tmp_path / "runs" / "cli-run").is_dir()  # nothing was discarded


def test_a_token_file_missing_here_is_not_launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "launch", _no_launch)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "mnt" / "train.bin"  # absolute: only a warning for validate, but this machine trains
    (tmp_path / "job.yaml").write_text(GOOD.replace("steps: 2}",
                                                    f"steps: 2, data: {{kind: tokens, path: {data}}}}}"))
    result = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert result.exit_code == 1 and "warning[DSF610]" in result.output and "is not here" in result.output
    assert not (tmp_path / "runs" / "cli-run").exists()


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_gpu_check_without_a_gpu_runs_nothing() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_check.sh would train")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], check=False, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU is visible" in proc.stderr and "Nothing was run" in proc.stderr
