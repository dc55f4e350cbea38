"""Interrupts: `compile --force` keeps the old job directory through Ctrl-C, SIGTERM and a kill; Ctrl-C during
start-up exits 130 without a traceback; `-o` refuses the working directory and a missing parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dsforge.compiler.emit import writer
from dsforge.interrupts import Terminated, catch_sigterm, exit_code
from tests.commands.test_compile import compile_, snapshot
from tests.test_compile_support import example_path

FILES = {"a.txt": writer.JobFile("new a"), "plan.json": writer.JobFile("{}")}


def earlier_compile(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path / "job"
    assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out)).exit_code == 0
    return out, snapshot(out)


def interrupt_rename(monkeypatch: pytest.MonkeyPatch, on_call: int, after: bool) -> list[tuple[str, str]]:
    """Make writer's ``on_call``-th os.replace raise KeyboardInterrupt, before or after it renamed."""
    real, calls = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        calls.append((str(src), str(dst)))
        if len(calls) == on_call and not after:
            raise KeyboardInterrupt
        real(src, dst)
        if len(calls) == on_call:
            raise KeyboardInterrupt

    monkeypatch.setattr(writer.os, "replace", replace)
    return calls


@pytest.mark.parametrize(("on_call", "after"), [(1, False), (1, True), (2, False), (2, True)],
                         ids=["before-aside", "after-aside", "before-swap", "after-swap"])
def test_an_interrupt_inside_the_rename_window_restores_the_old_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_call: int, after: bool) -> None:
    out, before = earlier_compile(tmp_path)
    calls = interrupt_rename(monkeypatch, on_call, after)
    with pytest.raises(KeyboardInterrupt):
        writer.write_job_dir(out, FILES, force=True)
    monkeypatch.undo()
    # the window was entered: the old target moved aside
    assert len(calls) >= on_call and calls[0][0] == str(out)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["job"]  # no aside, no temporary directory left


def test_ctrl_c_during_compile_force_exits_130_with_the_old_job_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out, before = earlier_compile(tmp_path)
    interrupt_rename(monkeypatch, 2, after=False)
    monkeypatch.setattr(sys, "argv", ["dsforge", "compile", "--no-rewrite", "--force", "-o", str(out),
                                      str(example_path("tiny-3d"))])
    from dsforge.cli import main

    with pytest.raises(SystemExit) as info:
        main()
    monkeypatch.undo()
    assert info.value.code == 130
    assert "Traceback" not in capsys.readouterr().err
    assert snapshot(out) == before and [p.name for p in tmp_path.iterdir()] == ["job"]


def test_sigterm_is_held_back_during_the_swap_and_raised_after_it(tmp_path: Path) -> None:
    out, _ = earlier_compile(tmp_path)
    restore = catch_sigterm()
    real, seen = writer._swap_in, []

    def swap_with_a_signal(tmp: Path, target: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the window
        time.sleep(0.05)  # a delivered signal would raise here, between the renames
        real(tmp, target)
        seen.append("swapped")

    try:
        writer._swap_in = swap_with_a_signal  # type: ignore[assignment]
        with pytest.raises(Terminated) as info:
            writer.write_job_dir(out, FILES, force=True)
    finally:
        writer._swap_in = real  # type: ignore[assignment]
        restore()
    assert seen == ["swapped"] and exit_code(info.value) == 143
    assert snapshot(out) == {"a.txt": b"new a", "plan.json": b"{}"}  # done whole, then interrupted
    assert [p.name for p in tmp_path.iterdir()] == ["job"]


def test_sigterm_is_held_back_even_with_other_threads_running(tmp_path: Path) -> None:
    # a thread mask would not hold it: the kernel hands the signal to a thread that does not block it
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        test_sigterm_is_held_back_during_the_swap_and_raised_after_it(tmp_path)
    finally:
        stop.set()
        other.join()


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def leftover(tmp_path: Path, target: str, pid: int, suffix: str, source: Path | None = None) -> Path:
    """A hidden sibling as a write killed at the wrong moment leaves it (``source`` moved there)."""
    path = tmp_path / f".{target}.{pid}.abcd_123.{suffix}"
    if source is not None:
        os.replace(source, path)
    else:
        path.mkdir()
        (path / "half").write_text("x")
    return path


def test_the_next_compile_restores_a_target_a_kill_left_aside(tmp_path: Path) -> None:
    out, before = earlier_compile(tmp_path)
    pid = dead_pid()
    leftover(tmp_path, "job", pid, "old", source=out)  # killed between the two renames
    leftover(tmp_path, "job", pid, "tmp")
    other = leftover(tmp_path, "job.5", pid, "old")  # another target's sibling: not ours to touch
    live = leftover(tmp_path, "job", os.getpid(), "tmp")  # a compile still running
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out))
    assert result.exit_code == 2 and "--force" in result.output  # the old job is back, so it is refused
    assert f"(first restored {out} from .job.{pid}.abcd_123.old" in result.output
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["job", other.name, live.name])


def test_a_stale_aside_is_removed_once_the_new_target_is_complete(tmp_path: Path) -> None:
    out, _ = earlier_compile(tmp_path)
    (tmp_path / "older").mkdir()
    stale = leftover(tmp_path, "job", dead_pid(), "old")  # killed after the swap, before deleting the aside
    result = compile_(str(example_path("tiny-3d")), "-o", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert f"note: removed {stale.name}" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "older"]


def test_recover_puts_back_a_missing_target_and_reports_it(tmp_path: Path) -> None:
    out, before = earlier_compile(tmp_path)
    aside = leftover(tmp_path, "job", dead_pid(), "old", source=out)
    out.mkdir()  # an empty target counts as missing
    restored = f"restored {out} from {aside.name}, left by a compile that was killed while replacing it"
    assert writer.recover(out) == [restored]
    assert snapshot(out) == before and writer.recover(out) == []


@pytest.mark.parametrize("where", [".", "..", "missing/job"])
def test_o_refuses_the_working_directory_its_parents_and_a_missing_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", where)
    assert result.exit_code == 2
    expected = "does not exist; create it first" if where.startswith("missing") else "working directory"
    assert expected in result.output, result.output
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


def test_run_o_refuses_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.commands.run import RunError, prepare

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match="is the working directory"):
        prepare(str(example_path("tiny-tp2-dp2")), ".", fresh=True)
    assert list(tmp_path.iterdir()) == []


SLOW_CLICK = """\
import os, sys, time

class SlowClick:
    # Stands for a slow disk: the import of click waits, after saying so, until Ctrl-C arrives.
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            sys.meta_path.remove(self)
            with open(os.environ["MARK"], "w") as fh:
                fh.write("importing click")
            time.sleep(60)
        return None

sys.meta_path.insert(0, SlowClick())
"""


@pytest.mark.parametrize("how", ["console-script", "python-m"])
def test_ctrl_c_during_start_up_imports_exits_130_without_a_traceback(tmp_path: Path, how: str) -> None:
    script = Path(sys.executable).parent / "dsforge"
    if how == "console-script" and not script.is_file():
        pytest.skip("the dsforge console script is not installed beside this interpreter")
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SLOW_CLICK), encoding="utf-8")
    mark = tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "MARK": str(mark)}
    cmd = [str(script)] if how == "console-script" else [sys.executable, "-m", "dsforge"]
    # A suite started in the background or under nohup inherits SIGINT ignored, and so would the child (Python
    # then installs no KeyboardInterrupt handler): give it the default disposition a terminal's command has.
    # An ignored signal stays ignored across exec, a handled one is reset to the default, so handle it while
    # starting.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*cmd, "validate", str(example_path("tiny-tp2-dp2"))], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 60
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.exists(), "the command never reached the import of click"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_sigterm_to_dsforge_run_stops_its_launcher_before_exiting(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.commands.run import launch

    (tmp_path / "plan.json").write_text('{"launcher": "local", "nodes": 1}', encoding="utf-8")
    (tmp_path / "launch.sh").write_text("trap 'echo stopped > term; exit 143' TERM\necho > started\n"
                                        "while true; do sleep 0.05; done\n", encoding="utf-8")
    restore = catch_sigterm()

    def kill_when_started() -> None:
        while not (tmp_path / "started").exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.chdir(tmp_path)  # the script writes its files where it runs
    try:
        threading.Thread(target=kill_when_started, daemon=True).start()
        with pytest.raises(Terminated):
            launch(tmp_path)
    finally:
        restore()
    assert (tmp_path / "term").read_text().strip() == "stopped"  # the launcher got SIGTERM and was waited for
