"""What a failed run says: the ranks' status files, `dsforge run`'s report of them, the fault hook's syntax
and the train log of a resumed run (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsforge.commands.run import failure_report
from dsforge.runtime import faults, rank_status
from dsforge.runtime.main import trim_log
from dsforge.runtime.rank_status import RankStatus, describe_failure


def job_dir(tmp_path: Path, world: int = 4, resume: str = "auto") -> Path:
    (tmp_path / "plan.json").write_text(json.dumps({"world_size": world, "job": {"training": {"checkpoint": {
        "dir": "checkpoints", "every": 1, "resume": resume}}}}), encoding="utf-8")
    return tmp_path


def test_a_killed_rank_is_named_with_its_step_and_the_stopped_ones_with_theirs(tmp_path: Path) -> None:
    d = job_dir(tmp_path)
    for r in range(4):
        RankStatus(d, r).update("training", 3)
    RankStatus(d, 0).update("stopped", 3, "by SIGTERM")
    RankStatus(d, 2).update("stopped", 3, "by SIGTERM")
    RankStatus(d, 3).update("failed", 3, "TrainingError: the loss is nan at step 3")
    lines = describe_failure(d, 4)
    assert lines[0].startswith("rank 1 (pid ") and "died during step 3 without a word" in lines[0]
    assert lines[1] == "rank 3 failed during step 3: TrainingError: the loss is nan at step 3"
    assert lines[2] == "ranks 0, 2 stopped during step 3 by SIGTERM"


def test_a_rank_killed_inside_a_save_is_reported_there(tmp_path: Path) -> None:
    d = job_dir(tmp_path, world=2)
    RankStatus(d, 0).update("done", 4)
    status = RankStatus(d, 1)
    status.update("training", 2)
    status.update("saving", 2)
    assert status.where() == "while saving the checkpoint of step 2"
    assert "died while saving the checkpoint of step 2" in describe_failure(d, 2)[0]


def test_the_report_names_the_checkpoint_a_rerun_resumes_from(tmp_path: Path) -> None:
    d = job_dir(tmp_path, world=2)
    RankStatus(d, 0).update("stopped", 3)
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest").write_text("step2")
    report = failure_report(d)
    assert "rank 1 never started (no status file)" in report
    assert (
        report[-1] == f"the last complete checkpoint is {d / 'checkpoints' / 'step2'}: run the same command "
        "again to resume from it"
    )
    (d / "checkpoints" / "latest").unlink()
    assert failure_report(d)[-1] == "no checkpoint was completed: run the same command again to start over"
    assert failure_report(job_dir(tmp_path, 2, "never"))[-1].startswith("rerunning starts over")


def test_clear_removes_an_earlier_launch_and_nothing_else(tmp_path: Path) -> None:
    d = job_dir(tmp_path, world=2)
    RankStatus(d, 0).update("done", 2)
    rank_status.clear(d)
    assert rank_status.read_all(d, 2) == {0: None, 1: None}
    assert describe_failure(d, 2) == []  # no rank wrote anything: nothing to say beyond the launcher's own
                                         # words
    assert (d / "plan.json").is_file()


def test_an_unwritable_status_directory_does_not_stop_training(tmp_path: Path) -> None:
    (tmp_path / "status").write_text("a file where the directory should be")
    RankStatus(tmp_path, 0).update("training", 1)  # no exception


@given(st.sampled_from(faults.HOWS), st.integers(0, 4096), st.sampled_from(faults.POINTS),
       st.integers(0, 10**6))
def test_fault_specs_round_trip(how: str, rank: int, point: str, step: int) -> None:
    assert faults.parse(f"{how}:{rank}:{point}:{step}") == (how, rank, point, step)


@pytest.mark.parametrize("text", ["kill:1:step", "boom:1:step:3", "kill:1:load:3", "kill:x:step:3"])
def test_a_bad_fault_spec_says_what_it_expects(text: str) -> None:
    with pytest.raises(ValueError, match="kill|expected|invalid literal"):
        faults.parse(text)


def test_fault_raises_only_on_its_rank_point_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "raise:1:save:2")
    monkeypatch.setenv("RANK", "0")
    faults.fault("save", 2)
    monkeypatch.setenv("RANK", "1")
    faults.fault("step", 2)
    faults.fault("save", 3)
    with pytest.raises(faults.InjectedFault):
        faults.fault("save", 2)


def test_a_resumed_run_drops_the_log_lines_of_the_steps_it_trains_again(tmp_path: Path) -> None:
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)) + "torn{\n")
    trim_log(tmp_path, 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    trim_log(tmp_path, 2)
    assert len(log.read_text().splitlines()) == 2
    trim_log(tmp_path / "missing", 0)  # no log yet: nothing to do
