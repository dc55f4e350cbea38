"""The job directory's lock (dsforge.runtime.run_lock) and the start checks of `dsforge run` (preflight),
fast.

A second process holds the lock as a running `dsforge run` does; tests/runtime_e2e/test_machine_faults.py
does it with a real training run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.commands import preflight
from dsforge.commands import run as runner
from dsforge.runtime import run_lock

HOLD = """
import sys, time
from pathlib import Path
from dsforge.runtime.run_lock import lock_job_dir
lock_job_dir(Path(sys.argv[1]), "dsforge run")
print("held", flush=True)
time.sleep(120)
"""

GOOD = """version: 1
name: lock-job
model: {preset: tiny-gpt2}
hardware: {preset: cpu-local, gpus_per_node: 1}
training: {global_batch: 2, micro_batch: 1, precision: fp32, steps: 2}
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(job)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc, job
    finally:
        proc.kill()
        proc.wait()
        run_lock.release_all()


def test_a_held_lock_is_refused_naming_pid_host_and_start(holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, job = holder
    with pytest.raises(run_lock.BusyError) as info:
        run_lock.lock_job_dir(job, "dsforge run")
    text = str(info.value)
    assert text.startswith(f"DSF612: {job} is in use by another dsforge command: pid {proc.pid} on host "
                           f"{socket.gethostname()}, since ")
    assert "(dsforge run)" in text and "-o" in text


def test_the_lock_of_a_dead_process_is_free_and_its_takeover_said(
        holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, job = holder
    proc.kill()
    proc.wait()  # the kernel dropped its flock; its details stay in the file
    lock = run_lock.lock_job_dir(job, "dsforge run")
    assert f"pid {proc.pid}" in lock.took_over and "which is no longer running" in lock.took_over
    held = json.loads(run_lock.lock_file_of_job(job).read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    run_lock.release_all()
    assert run_lock.lock_job_dir(job, "dsforge run").took_over == ""  # a released lock names no holder
    run_lock.release_all()


def test_compile_force_and_run_refuse_a_busy_directory(holder: tuple[subprocess.Popen[str], Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    proc, job = holder
    (job.parent / "job.yaml").write_text(GOOD)
    assert CliRunner().invoke(cli, ["compile", str(job.parent / "job.yaml"), "-o", str(job.parent / "other"),
                                    "--no-rewrite"]).exit_code == 0
    os.replace(job.parent / "other", job)  # a compiled job directory, its lock held by the other process
    before = sorted(p.name for p in job.iterdir())
    forced = CliRunner().invoke(cli, ["compile", str(job.parent / "job.yaml"), "-o", str(job), "--force",
                                      "--no-rewrite"])
    assert forced.exit_code == 2 and f"pid {proc.pid}" in forced.output, forced.output
    monkeypatch.setattr(runner, "launch", lambda d: pytest.fail(f"launched {d}"))
    ran = CliRunner().invoke(cli, ["run", str(job.parent / "job.yaml"), "-o", str(job)])
    assert ran.exit_code == 2 and "DSF612" in ran.output and f"pid {proc.pid}" in ran.output, ran.output
    assert sorted(p.name for p in job.iterdir()) == before


def test_an_outside_checkpoint_directory_is_locked_too(tmp_path: Path) -> None:
    outside, job = tmp_path / "shared-ckpt", tmp_path / "job"
    assert run_lock.lock_checkpoint_dir(tmp_path / "job" / "checkpoints", job, "dsforge run") is None
    lock = run_lock.lock_checkpoint_dir(outside, job, "dsforge run")
    assert lock is not None and lock.path == outside / run_lock.CHECKPOINT_LOCK
    code = ("import sys; from pathlib import Path; from dsforge.runtime.run_lock import lock_checkpoint_dir\n"
            "try:\n lock_checkpoint_dir(Path(sys.argv[1]), Path(sys.argv[2]), 'dsforge run')\n"
            "except Exception as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code, str(outside), str(tmp_path / "job2")],
                         capture_output=True, text=True, check=True).stdout
    assert "DSF612: the checkpoint directory" in out and "must not share one training.checkpoint.dir" in out
    run_lock.release_all()


def _plan(keep: object, saves: int, each: int) -> dict[str, object]:
    return {"summary": {"checkpoint": {"bytes_total": each, "keep": keep, "saves": saves}}}


def test_free_space_refuses_with_a_keep_and_warns_without(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsforge.runtime.disk_space.free_bytes", lambda p: 10_000)
    assert preflight.space_check(tmp_path, _plan(2, 10, 3000)) == []  # 3 x 3,000 fit
    with pytest.raises(preflight.PreflightError, match=r"DSF614: .* 10,000 bytes free; "
                                                       r".* need 12,000 .*keep: 3"):
        preflight.space_check(tmp_path, _plan(3, 10, 3000))
    warned = preflight.space_check(tmp_path, _plan("all", 10, 3000))
    assert len(warned) == 1 and warned[0].startswith("warning: DSF614") and "30,000" in warned[0]


def test_a_stale_build_lock_is_refused_naming_the_file(tmp_path: Path) -> None:
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    now = time.time()
    assert "another start is building" in preflight.build_lock_check(tmp_path, now)[0]  # just taken
    with pytest.raises(preflight.PreflightError, match=rf"DSF617: {lock}: .*no process works in its "
                                                       rf"build.*rm {lock}$"):
        # and nothing builds there
        preflight.build_lock_check(tmp_path, now + preflight.IDLE_BUILD_LOCK_S + 5)
    building = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # as ninja runs in the build directory
    try:
        assert "another start is building" in preflight.build_lock_check(tmp_path, now + 300)[0]
        with pytest.raises(preflight.PreflightError, match="DSF617"):  # a build does not take 15 minutes
            preflight.build_lock_check(tmp_path, now + preflight.STALE_BUILD_LOCK_S + 60)
    finally:
        building.kill()
        building.wait()
    assert preflight.build_lock_check(tmp_path / "none", now) == []


def test_dsforge_run_refuses_to_start_over_a_stale_build_lock(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - preflight.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(runner, "launch",
                        lambda d: pytest.fail(f"launched {d}: it would wait for {lock} forever"))
    (tmp_path / "job.yaml").write_text(GOOD)
    ran = CliRunner().invoke(cli, ["run", str(tmp_path / "job.yaml"), "-o", str(tmp_path / "job")])
    assert ran.exit_code == 2 and f"DSF617: {lock}" in ran.output and f"rm {lock}" in ran.output, ran.output
    assert not run_lock.held()  # the command's locks ended with it


def test_two_job_files_validated_together_must_not_share_a_checkpoint_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared-ckpt"
    for name in ("a", "b", "c"):
        directory = shared if name != "c" else tmp_path / "own"
        text = GOOD.replace("lock-job", f"job-{name}").replace("steps: 2}",
                                                               f"steps: 2, checkpoint: {{dir: "
                                                               f"{directory}}}}}")
        (tmp_path / f"{name}.yaml").write_text(text)
    both = CliRunner().invoke(cli, ["validate", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"),
                                    str(tmp_path / "c.yaml")])
    assert both.exit_code == 1, both.output
    lines = [x for x in both.output.splitlines() if "DSF613" in x]
    assert (
        len(lines) == 2
        and lines[0].startswith(f"{tmp_path / 'a.yaml'}:5:")
        and str(tmp_path / "b.yaml") in lines[0]
    )
    assert lines[1].startswith(f"{tmp_path / 'b.yaml'}:5:") and str(tmp_path / "a.yaml") in lines[1]
    alone = CliRunner().invoke(cli, ["validate", str(tmp_path / "a.yaml"), str(tmp_path / "c.yaml")])
    assert alone.exit_code == 0 and "DSF613" not in alone.output, alone.output
