"""How a rank ends when it cannot finish: one line and its status file for a signal, a lost peer or a job
error; a bug keeps its traceback (one process, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from dsforge.interrupts import Terminated
from dsforge.runtime.checkpoint import CheckpointError
from dsforge.runtime.main import _first_line, _stopped, lost_peer
from dsforge.runtime.rank_status import RankStatus, path_of

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:38821: Connection reset by peer. This is typically caused by a remote worker "
              "hanging or bugs in the application. Check the logs "
              "of the remote worker before reporting an error.")


def ended(tmp_path: Path, exc: BaseException,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, object], str]:
    status = RankStatus(tmp_path, 3)
    status.update("training", 7)
    code = _stopped(exc, 3, status)
    return code, json.loads(path_of(tmp_path, 3).read_text()), capsys.readouterr().err


def test_sigterm_and_ctrl_c_stop_with_the_step_and_the_shells_exit_codes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, err = ended(tmp_path, Terminated(), capsys)
    assert code == 143 and doc["phase"] == "stopped"
    assert err == ("dsforge: rank 3: stopped during step 7 by SIGTERM "
                   "(a launcher ends every rank when one fails)\n")
    code, doc, err = ended(tmp_path, KeyboardInterrupt(), capsys)
    assert code == 130 and err == "dsforge: rank 3: stopped during step 7 by Ctrl-C\n"


def test_a_collective_with_a_dead_peer_is_one_line_without_gloos_boilerplate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert lost_peer(RuntimeError(GLOO_RESET)) and lost_peer(dist.DistBackendError("x"))
    assert not lost_peer(RuntimeError("shape mismatch")) and not lost_peer(
        ValueError("Connection reset by peer")
    )
    assert _first_line(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:38821: Connection reset by peer."
    code, doc, err = ended(tmp_path, RuntimeError(GLOO_RESET), capsys)
    assert code == 1 and doc["phase"] == "stopped"
    assert err == ("dsforge: rank 3: stopped during step 7 after losing contact with another rank (Read "
                   "error [127.0.0.1]:38821: Connection reset by peer.): it died or stopped\n")


def test_a_job_error_fails_in_one_line_and_a_bug_keeps_its_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, err = ended(tmp_path, CheckpointError("cannot resume from x"), capsys)
    assert code == 1 and doc == {**doc, "phase": "failed", "message": "cannot resume from x"}
    assert err == "dsforge: rank 3: cannot resume from x\n"
    status = RankStatus(tmp_path, 3)
    with pytest.raises(ZeroDivisionError):
        _stopped(ZeroDivisionError("division by zero"), 3, status)
    doc = json.loads(path_of(tmp_path, 3).read_text())
    assert doc["phase"] == "failed" and doc["message"] == ("ZeroDivisionError: division "
                                                           "by zero (traceback above)")
