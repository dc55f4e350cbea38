"""A rank of `dsforge run` dies: the others stop within the bound, the run names the dead rank and the step, and
running the same command again resumes from the last complete checkpoint to the uninterrupted run's losses.

The job is test_continue's (tiny-gpt2, DP2 with ZeRO-1 on 2 CPU ranks, SGD with momentum), 4 steps with
a checkpoint after every step. ``DSFORGE_FAULT`` (dsforge.runtime.faults) makes rank 1 SIGKILL itself
at the start of step 3, or inside the save of step 2 once its part of the checkpoint is written; once
it raises instead. The bound: torchrun stops the other ranks as soon as it sees one die (they also
fail their next collective with the dead peer at once); whatever blocks them, the process-group
timeout (``DSFORGE_TIMEOUT_S``, 60 s here, 600 s by default) ends it. The rerun's losses, steps 1-4
of train_log.jsonl, must equal the single-process reference of an uninterrupted 4-step run
(harness.reference_run) to the e2e tolerance, as an uninterrupted `dsforge run` does (test_continue).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.parse import load_job
from tests.runtime_e2e.harness import RTOL, SGD_DEEPSPEED, reference_run, training

JOB = "lost-rank"
TIMEOUT_S = 60


def write_job(path: Path) -> None:
    doc = {"version": 1, "name": JOB, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"dp": "auto", "zero": 1},
           "training": training(steps=4, checkpoint={"every": 1}, grad_clip=1.0e5), "deepspeed": SGD_DEEPSPEED}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


def status(job_dir: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((job_dir / "status" / f"rank-{rank}.json").read_text(encoding="utf-8")))


def logged(job_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (job_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    path = tmp_path_factory.mktemp("reference") / "job.yaml"
    write_job(path)
    job = load_job(path)[0]
    assert job is not None
    return reference_run(job.spec, steps=4)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "where", "latest"), [("kill:1:step:3", "during step 3", "step2"),
                                                        ("kill:1:save:2", "while saving the checkpoint of step 2",
                                                         "step1")],
                         ids=["mid-run", "during-a-checkpoint-write"])
def test_a_killed_rank_stops_the_run_and_the_rerun_resumes_to_the_same_losses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], reference: list[float],
        fault: str, where: str, latest: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSFORGE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("DSFORGE_FAULT", fault)
    write_job(tmp_path / "job.yaml")
    job_dir, checkpoints = tmp_path / "runs" / JOB, tmp_path / "runs" / JOB / "checkpoints"

    failed = CliRunner().invoke(cli, ["run", "job.yaml"])
    out, err = capfd.readouterr()
    assert failed.exit_code == 1, failed.output + err[-4000:]
    assert f"dsforge run: rank 1 (pid {status(job_dir, 1)['pid']} on " in failed.output
    assert f"died {where} without a word" in failed.output, failed.output
    assert f"the last complete checkpoint is {checkpoints / latest}" in failed.output
    survivor, dead = status(job_dir, 0), status(job_dir, 1)
    assert survivor["phase"] == "stopped" and f"stopped {where}" in err, err[-4000:]
    # the dead rank's last word was at the fault; the survivor's when it stopped
    assert float(survivor["time"]) - float(dead["time"]) < TIMEOUT_S, (survivor, dead)
    assert (checkpoints / "latest").read_text().strip() == latest  # a half-written checkpoint is never latest
    if "save" in fault:
        assert (checkpoints / "step2.partial").is_dir() and not (checkpoints / "step2").exists()

    monkeypatch.delenv("DSFORGE_FAULT")
    t0 = time.monotonic()
    rerun = CliRunner().invoke(cli, ["run", "job.yaml"])
    out, err = capfd.readouterr()
    assert rerun.exit_code == 0, rerun.output + out[-3000:] + err[-3000:]
    assert f"resumed from {checkpoints / latest} after step {latest[-1]}" in out, out[-3000:]
    log = logged(job_dir)
    assert [e["step"] for e in log] == [1, 2, 3, 4]  # the lost steps were trained again, and logged once
    assert [e["loss"] for e in log] == pytest.approx(reference, rel=RTOL)
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step1", "step2", "step3", "step4"]
    assert time.monotonic() - t0 < 600


@pytest.mark.slow
def test_an_exception_on_one_rank_is_reported_with_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSFORGE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("DSFORGE_FAULT", "raise:1:step:2")
    write_job(tmp_path / "job.yaml")
    failed = CliRunner().invoke(cli, ["run", "job.yaml"])
    _, err = capfd.readouterr()
    assert failed.exit_code == 1, failed.output + err[-4000:]
    assert ("dsforge run: rank 1 failed during step 2: InjectedFault: DSFORGE_FAULT: injected failure at step 2 "
            "(traceback above)") in failed.output, failed.output
    assert "the last complete checkpoint is" in failed.output and "step1" in failed.output
