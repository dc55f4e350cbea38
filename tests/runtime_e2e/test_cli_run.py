"""`dsforge run` before it launches anything, and benchmarks/gpu_check.sh without a GPU (both fast).

A job with errors must print them and exit 1 without starting a launcher; a Python without torch
must be told how to install it (exit 2); a second `dsforge run` of the same compile reuses the job
directory (to resume), a changed job is refused unless --fresh; gpu_check.sh must say that it
needs a GPU and run nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge import runner
from dsforge.cli import cli

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


def test_same_compile_is_reused_and_a_changed_one_needs_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[Path] = []
    monkeypatch.setattr(runner, "launch", lambda d: launched.append(d) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(GOOD)
    first = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert first.exit_code == 0, first.output
    job_dir = tmp_path / "runs" / "cli-run"
    (job_dir / "checkpoints").mkdir()  # what a run leaves behind
    again = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert again.exit_code == 0 and "resuming the earlier run" in again.output
    (tmp_path / "job.yaml").write_text(GOOD.replace("steps: 2", "steps: 3"))
    changed = CliRunner().invoke(cli, ["run", "job.yaml"])
    assert changed.exit_code == 2 and "--fresh" in changed.output
    fresh = CliRunner().invoke(cli, ["run", "job.yaml", "--fresh"])
    assert fresh.exit_code == 0 and not (job_dir / "checkpoints").exists()
    assert launched == [job_dir, job_dir, job_dir]
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".dsforge-run-")]


def test_gpu_check_without_a_gpu_runs_nothing() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_check.sh would train")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], check=False, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU is visible" in proc.stderr and "Nothing was run" in proc.stderr
