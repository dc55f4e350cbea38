"""A finished `dsforge run`, continued by raising training.steps, then under another layout, without the venv
on PATH.

One tiny job (tiny-gpt2, DP2 with ZeRO-1 on 2 CPU ranks, SGD with momentum at a constant rate, the
harness's training keys) runs 2 steps through `dsforge run`; the job file then asks for 4 and the same
command trains only steps 3 and 4 from the step-2 checkpoint; then it asks for 6 under tp2 (ZeRO-0,
micro-batch 2), and the same command re-writes the job directory and trains steps 5 and 6 from the
step-4 checkpoint's layout-free state. Every run starts with PATH=/usr/bin:/bin, so the launcher must
find its interpreter without PATH. Every step's loss must equal the single-process reference of an
uninterrupted 6-step run (harness.reference_run) to the e2e tolerance: a resume that lost the
momentum, re-read earlier samples, restarted the schedule or put a slice in another rank's place would not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.frontend.parse import load_job
from tests.runtime_e2e.harness import RTOL, SGD_DEEPSPEED, reference_run, training
from tests.runtime_e2e.test_machine_faults import assert_checkpoint_size

JOB = "continued"


def write_job(path: Path, steps: int, parallel: dict[str, int] | None = None, micro: int = 1) -> None:
    doc = {"version": 1, "name": JOB, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2},
           "parallel": {"dp": "auto", **(parallel or {"zero": 1})},
           "training": training(steps=steps, micro_batch=micro), "deepspeed": SGD_DEEPSPEED}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


def logged(job_dir: Path) -> list[dict[str, float]]:
    return [
        json.loads(line) for line in (job_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    ]


@pytest.mark.slow
def test_raising_steps_continues_from_the_checkpoint_like_an_uninterrupted_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no venv, no pyenv shims: `python` here has no torch
    monkeypatch.setenv("DSFORGE_TIMEOUT_S", "120")
    path = tmp_path / "job.yaml"
    job_dir = tmp_path / "runs" / JOB
    write_job(path, 2)
    first = CliRunner().invoke(cli, ["run", "job.yaml"])
    out = capfd.readouterr().out
    assert first.exit_code == 0, first.output + out[-4000:]
    assert [e["step"] for e in logged(job_dir)] == [1, 2]
    assert (job_dir / "checkpoints" / "latest").read_text().strip() == "step2"
    assert_checkpoint_size(job_dir, job_dir / "checkpoints" / "step2")  # DP2 ZeRO-1 (issue 26)

    write_job(path, 4)
    second = CliRunner().invoke(cli, ["run", "job.yaml"])
    out = capfd.readouterr().out
    assert second.exit_code == 0, second.output + out[-4000:]
    assert "continuing the earlier run" in second.output and "training.steps 2 -> 4" in second.output
    assert f"resumed from {job_dir / 'checkpoints' / 'step2'} after step 2" in out, out[-4000:]
    log = logged(job_dir)
    assert [e["step"] for e in log] == [1, 2, 3, 4]  # the second run trained only steps 3 and 4
    assert (job_dir / "checkpoints" / "latest").read_text().strip() == "step4"

    write_job(path, 6, {"tp": 2, "zero": 0}, micro=2)  # another layout: only the checkpoint's dense state
                                                       # carries
    third = CliRunner().invoke(cli, ["run", "job.yaml"])
    out = capfd.readouterr().out
    assert third.exit_code == 0, third.output + out[-4000:]
    assert "the layout changes (dp2 ZeRO-1 -> tp2 ZeRO-0)" in third.output, third.output
    assert f"resumed from {job_dir / 'checkpoints' / 'step4'} after step 4" in out, out[-4000:]
    log = logged(job_dir)
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5, 6]
    assert_checkpoint_size(job_dir, job_dir / "checkpoints" / "step6")  # TP2 ZeRO-0

    spec = load_job(path)[0]
    assert spec is not None
    want, _ = reference_run(spec.spec, steps=6)
    assert [e["loss"] for e in log] == pytest.approx(want, rel=RTOL)
