"""Faults of the machine on real `dsforge run` jobs (one CPU rank, tiny-gpt2): each one as a cluster user
meets it.

* A second `dsforge run` (and `compile --force`) on a job directory a run is training in is refused
  within seconds naming the holder, and the first run's log and checkpoints are its own alone.
* A save onto a full file system (a small tmpfs, mounted here as root) ends with the DSF616 line;
  `latest` stays on the last complete checkpoint, the partial one is gone, and the rerun on the same
  file system grown resumes from it.
* A flipped byte (DeepSpeed's model file) and a truncated file (dsforge's layout-free state) are each
  refused naming the file, at resume and by `dsforge export`; with ``if_damaged: fall_back`` the run
  resumes from the newest intact checkpoint, says so, and records it in memory_report.json.
* ``keep: 2`` leaves exactly two checkpoints and `latest`, through the fallback and the resume.

The checkpoint size explain states (plan.json's summary.checkpoint) is compared with the real one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from dsforge.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def write_job(path: Path, name: str, steps: int, every: int, **checkpoint: Any) -> None:
    doc = {"version": 1, "name": name, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 1},
           "training": {"global_batch": 2, "micro_batch": 1, "precision": "fp32", "steps": steps, "seed": 5,
                        "checkpoint": {"every": every, **checkpoint}}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


def logged(job_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (job_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    ]


def tags(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def run(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    out, err = capfd.readouterr()
    return result.exit_code, result.output + out + err


def assert_checkpoint_size(job_dir: Path, tag_dir: Path) -> None:
    """explain's `checkpoint on disk` (plan.json's summary.checkpoint) within 5 % of the real checkpoint's
    bytes."""
    planned = json.loads((job_dir / "plan.json").read_text())["summary"]["checkpoint"]["bytes_total"]
    real = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
    assert abs(planned - real) / real < 0.05, (tag_dir, planned, real)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_a_second_run_on_a_busy_directory_is_refused_and_the_first_is_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    steps = 1500
    write_job(tmp_path / "job.yaml", "busy", steps=steps, every=500)
    job_dir = tmp_path / "job"
    first = subprocess.Popen([sys.executable, "-m", "dsforge", "run", "job.yaml", "-o", str(job_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (job_dir / "train_log.jsonl").is_file():  # training has started
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-4000:]
            time.sleep(0.5)
        t0 = time.monotonic()
        code, text = run(["run", "job.yaml", "-o", str(job_dir)], capfd)
        refused_s = time.monotonic() - t0
        assert code == 2 and "DSF612" in text and f"pid {first.pid} on host" in text, text
        assert refused_s < 30, refused_s  # seconds: nothing was compiled or launched
        forced, text = run(["compile", "job.yaml", "-o", str(job_dir), "--force", "--no-rewrite"], capfd)
        assert forced == 2 and f"pid {first.pid}" in text, text
        assert first.poll() is None, "the first run must still be training when the second is refused"
        out = first.communicate(timeout=1200)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, out[-4000:]
    assert [e["step"] for e in logged(job_dir)] == list(range(1, steps + 1))  # each step logged once
    assert tags(job_dir / "checkpoints") == ["latest", "step1000", "step1500", "step500"]
    assert out.count("dsforge: busy: 1 rank") == 1  # one training started


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"a full disk needs a small tmpfs, and `mount -t tmpfs` is not permitted here "
                    f"({proc.stderr.strip()}); run as root (CI does)")


@pytest.mark.slow
def test_a_save_onto_a_full_disk_says_so_and_the_rerun_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "5m")  # one checkpoint of the job is 3.5 MB: the first fits, the second does not
    try:
        write_job(tmp_path / "job.yaml", "full-disk", steps=3, every=1, dir=str(disk / "ck"), keep=1)
        code, text = run(["run", "job.yaml", "-o", "job"], capfd)
        assert code == 2 and "DSF614" in text and "lower training.checkpoint.keep" in text, text[-3000:]

        write_job(tmp_path / "job.yaml", "full-disk", steps=3, every=1, dir=str(disk / "ck"))
        code, text = run(["run", "job.yaml", "-o", "job"], capfd)
        assert code == 1, text[-4000:]
        assert "warning: DSF614" in text  # keep: all, and the retention does not fit: said, not refused
        line = next(x for x in text.splitlines() if "DSF616" in x)
        assert (f"the file system of {disk / 'ck'} is full: the "
                f"checkpoint of step 2 (step2.partial, removed)") in line
        assert "bytes (as step1 measured)" in line and "bytes are free" in line, line
        assert "Traceback" not in text and "unexpected pos" not in text, text[-4000:]
        assert (disk / "ck" / "latest").read_text() == "step1" and tags(disk / "ck") == ["latest", "step1"]
        assert [e["step"] for e in logged(tmp_path / "job")] == [1, 2]

        subprocess.run(["mount", "-o", "remount,size=40m", str(disk)], check=True)
        code, text = run(["run", "job.yaml", "-o", "job"], capfd)
        assert code == 0, text[-4000:]
        assert f"resumed from {disk / 'ck' / 'step1'} after step 1" in text
        assert [e["step"] for e in logged(tmp_path / "job")] == [1, 2, 3]
        assert tags(disk / "ck") == ["latest", "step1", "step2", "step3"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _resume_refused(capfd: pytest.CaptureFixture[str], tag_dir: Path, damaged: Path) -> None:
    code, text = run(["run", "job.yaml", "-o", "job"], capfd)
    assert code == 1, text[-4000:]
    assert f"DSF615: the checkpoint {tag_dir} is damaged: {damaged}" in text, text[-4000:]
    assert "Traceback" not in text
    code, text = run(["export", "job", "-o", "exported"], capfd)
    assert code == 1 and "DSF615" in text and str(damaged) in text, text[-3000:]
    assert not Path("exported").exists()


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_or_falls_back_and_keep_leaves_two(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    job_dir, ck = tmp_path / "job", tmp_path / "job" / "checkpoints"
    write_job(tmp_path / "job.yaml", "damaged", steps=4, every=1, keep=2)
    code, text = run(["run", "job.yaml", "-o", "job"], capfd)
    assert code == 0, text[-4000:]
    assert tags(ck) == ["latest", "step3", "step4"]  # keep: 2
    losses = {e["step"]: e["loss"] for e in logged(job_dir)}

    assert_checkpoint_size(job_dir, ck / "step4")

    write_job(tmp_path / "job.yaml", "damaged", steps=6, every=1, keep=2)
    model = ck / "step4" / "mp_rank_00_model_states.pt"
    original = model.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01  # one bit in the middle of the weights
    model.write_bytes(bytes(flipped))
    _resume_refused(capfd, ck / "step4", model)
    model.write_bytes(original)

    state = ck / "step4" / "dsforge-state" / "rank0.safetensors"
    state_bytes = state.read_bytes()
    state.write_bytes(state_bytes[: len(state_bytes) - 1000])
    _resume_refused(capfd, ck / "step4", state)

    write_job(tmp_path / "job.yaml", "damaged", steps=6, every=1, keep=2, if_damaged="fall_back")
    code, text = run(["run", "job.yaml", "-o", "job"], capfd)
    assert code == 0, text[-4000:]
    assert "step4 is damaged" in text and (f"resuming from the newest intact checkpoint, "
                                           f"{ck / 'step3'}") in text
    assert f"resumed from {ck / 'step3'} after step 3" in text
    report = json.loads((job_dir / "memory_report.json").read_text())["resume"]
    assert report["tag"] == "step3" and report["skipped"][0]["tag"] == "step4"
    assert str(state) in report["skipped"][0]["problems"][0]
    again = {e["step"]: e["loss"] for e in logged(job_dir)}
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    assert again[4] == pytest.approx(losses[4], rel=1e-6)  # step 4 retrained from step 3: the same loss
    assert tags(ck) == ["latest", "step5", "step6"] and (ck / "latest").read_text() == "step6"

    code, text = run(["export", "job", "-o", "exported"], capfd)
    assert code == 0 and "wrote" in text, text[-3000:]
    shutil.rmtree("exported")
