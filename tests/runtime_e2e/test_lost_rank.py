"""A rank of `dsforge run` dies: the others stop within the bound, the run names the dead rank and the step,
and running the same command again resumes from the last complete checkpoint to the uninterrupted run's
losses.

The job is tiny-gpt2 at TP2 x DP2 with ZeRO-1 on 4 CPU ranks (SGD with momentum), 4 steps with a
checkpoint after every step. One run is lost in every way in turn, each rerun resuming the previous one,
since a 4-rank launch is the expensive part: ``DSFORGE_FAULT`` (dsforge.runtime.faults) makes rank 3
SIGKILL itself at the start of step 3; then, in the rerun, inside the save of step 3 once its part of
the checkpoint is written; then raise at the start of step 4; the last rerun finishes. The bound: torchrun
stops the other ranks as soon as it sees one die (they also fail their next collective with the dead peer at
once); whatever blocks them, the process-group timeout (``DSFORGE_TIMEOUT_S``, 60 s here, 600 s by default)
ends it. The final losses, steps 1-4 of train_log.jsonl, must equal the single-process reference of an
uninterrupted 4-step run (harness.reference_run) to the e2e tolerance, as an uninterrupted `dsforge run` does
(test_continue).
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
from dsforge.compiler.frontend.parse import load_job
from tests.runtime_e2e.harness import RTOL, SGD_DEEPSPEED, reference_run, training

JOB = "lost-rank"
WORLD, DEAD = 4, 3
TIMEOUT_S = 60


def write_job(path: Path) -> None:
    doc = {"version": 1, "name": JOB, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": WORLD},
           "parallel": {"tp": 2, "dp": "auto", "zero": 1},
           "training": training(steps=4, checkpoint={"every": 1}, grad_clip=1.0e5),
           "deepspeed": SGD_DEEPSPEED}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


def status(job_dir: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((job_dir / "status" / f"rank-{rank}.json").read_text(encoding="utf-8")))


def logged(job_dir: Path) -> list[dict[str, float]]:
    return [
        json.loads(line) for line in (job_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    path = tmp_path_factory.mktemp("reference") / "job.yaml"
    write_job(path)
    job = load_job(path)[0]
    assert job is not None
    return reference_run(job.spec, steps=4)[0]


def _lost(job_dir: Path, capfd: pytest.CaptureFixture[str], where: str, latest: str) -> tuple[str, str]:
    """One launch in which rank DEAD dies `where`: exit 1, the dead rank named, every survivor stopped within
    the bound, and `latest` still the last complete checkpoint."""
    failed = CliRunner().invoke(cli, ["run", "job.yaml"])
    out, err = capfd.readouterr()
    assert failed.exit_code == 1, failed.output + err[-4000:]
    assert (f"the last complete checkpoint is "
            f"{job_dir / 'checkpoints' / latest}") in failed.output, failed.output
    dead = status(job_dir, DEAD)
    for rank in set(range(WORLD)) - {DEAD}:  # every survivor stopped, within the bound after the death
        survivor = status(job_dir, rank)
        assert survivor["phase"] == "stopped", (rank, survivor)
        assert float(survivor["time"]) - float(dead["time"]) < TIMEOUT_S, (rank, survivor, dead)
    assert (job_dir / "checkpoints" / "latest").read_text().strip() == latest  # never a half-written one
    return failed.output, out + err


@pytest.mark.slow
def test_a_lost_rank_stops_the_run_and_each_rerun_resumes_to_the_same_losses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        reference: list[float]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSFORGE_TIMEOUT_S", str(TIMEOUT_S))
    write_job(tmp_path / "job.yaml")
    job_dir, checkpoints = tmp_path / "runs" / JOB, tmp_path / "runs" / JOB / "checkpoints"
    began = time.monotonic()

    monkeypatch.setenv("DSFORGE_FAULT", f"kill:{DEAD}:step:3")  # killed mid-run
    said, logs = _lost(job_dir, capfd, "during step 3", "step2")
    assert f"dsforge run: rank {DEAD} (pid {status(job_dir, DEAD)['pid']} on " in said
    assert "died during step 3 without a word" in said and ("stopped during step "
                                                            "3") in logs, said + logs[-4000:]

    monkeypatch.setenv("DSFORGE_FAULT", f"kill:{DEAD}:save:3")  # the rerun is killed writing a checkpoint
    said, logs = _lost(job_dir, capfd, "while saving the checkpoint of step 3", "step2")
    assert f"resumed from {checkpoints / 'step2'} after step 2" in logs, logs[-4000:]
    assert "died while saving the checkpoint of step 3 without a word" in said, said
    assert (checkpoints / "step3.partial").is_dir() and not (checkpoints / "step3").exists()

    monkeypatch.setenv("DSFORGE_FAULT", f"raise:{DEAD}:step:4")  # an exception on one rank
    said, logs = _lost(job_dir, capfd, "during step 4", "step3")
    assert (f"dsforge run: rank {DEAD} failed during step 4: InjectedFault: DSFORGE_FAULT: injected failure "
            f"at step 4 (traceback above)") in said, said

    monkeypatch.delenv("DSFORGE_FAULT")
    rerun = CliRunner().invoke(cli, ["run", "job.yaml"])
    out, err = capfd.readouterr()
    assert rerun.exit_code == 0, rerun.output + out[-3000:] + err[-3000:]
    assert f"resumed from {checkpoints / 'step3'} after step 3" in out, out[-3000:]
    log = logged(job_dir)
    assert [e["step"] for e in log] == [1, 2, 3, 4]  # the lost steps were trained again, and logged once
    assert [e["loss"] for e in log] == pytest.approx(reference, rel=RTOL)
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step1", "step2", "step3", "step4"]
    assert time.monotonic() - began < 1200
