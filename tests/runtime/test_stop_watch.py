"""A rank's SIGTERM is taken by the watcher thread: the status file gets its last word at once, a main thread
in Python code unwinds with Terminated, and one stuck where Python cannot interrupt it (here a sleep that no
signal wakes, as a gloo wait) is ended after the grace period instead of waiting for the launcher's
SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two interpreters started, one waits out the grace

SCRIPT = """
import sys, threading, time
from pathlib import Path
from dsforge.interrupts import Terminated, catch_sigterm
from dsforge.runtime import stop_watch
from dsforge.runtime.rank_status import RankStatus

stop_watch.GRACE_S = 1.0
catch_sigterm()
status = RankStatus(Path(sys.argv[1]), 3)
status.update("saving", step=7)
assert stop_watch.watch_sigterm(status, 3)
def ready_when_asleep(main: int) -> None:
    # "ready" once the main thread is inside its sleep, so the signal cannot land before it
    while open(f"/proc/self/task/{main}/wchan").read().strip() != "hrtimer_nanosleep":
        time.sleep(0.01)
    print("ready", flush=True)


try:
    if sys.argv[2] == "stuck":
        threading.Thread(target=ready_when_asleep, args=(threading.main_thread().native_id,)).start()
        time.sleep(600)  # no signal reaches this thread: like a C++ collective, it never returns to Python
    else:
        print("ready", flush=True)
        while True:
            sum(range(1000))
except Terminated:
    status.update("stopped", message="main thread")
    print("unwound", flush=True)
    sys.exit(143)
"""


def _run(tmp_path: Path, mode: str) -> tuple[int, str, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, time.monotonic() - began


def _status(tmp_path: Path) -> dict[str, object]:
    return dict(json.loads((tmp_path / "status" / "rank-3.json").read_text(encoding="utf-8")))


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks")
def test_a_main_thread_in_python_unwinds_and_keeps_where_it_was(tmp_path: Path) -> None:
    code, out, err, _ = _run(tmp_path, "busy")
    assert code == 143 and "unwound" in out, err
    assert _status(tmp_path)["phase"] == "stopped"
    assert "process ends now" not in err


@pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="needs Linux's /proc/<tid>/wchan")
def test_a_main_thread_stuck_outside_python_is_ended_after_the_grace_with_its_last_word(
    tmp_path: Path,
) -> None:
    code, out, err, spent = _run(tmp_path, "stuck")
    assert code == 143 and "unwound" not in out, (out, err)
    assert 1.0 <= spent < 30, spent  # the grace, not the launcher's SIGKILL (which would be -9)
    doc = _status(tmp_path)
    assert doc["phase"] == "stopped" and "SIGTERM" in str(doc["message"]) and doc["step"] == 7
    assert "rank 3: stopped while saving the checkpoint of step 7 by SIGTERM" in err, err
