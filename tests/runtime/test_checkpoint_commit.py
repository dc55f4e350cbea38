"""A checkpoint save is a commit: until every rank's part is written, `latest` names the previous checkpoint.

The engine here writes what DeepSpeed's save_checkpoint writes in outline (a directory per tag, a file
per part) in one process; tests/runtime_e2e/test_lost_rank.py kills a real rank inside a real save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsforge.runtime import checkpoint as ckpt
from dsforge.runtime.faults import ENV, InjectedFault


class Engine:
    """save_checkpoint / load_checkpoint over plain files (no DeepSpeed)."""

    def __init__(self) -> None:
        self.saved_latest: list[bool] = []

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any],
                        save_latest: bool) -> None:
        self.saved_latest.append(save_latest)
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_text(json.dumps(client_state))

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str, dict[str, Any]]:
        d = Path(load_dir) / tag
        return str(d), json.loads((d / "mp_rank_00_model_states.pt").read_text())


def policy(tmp_path: Path) -> ckpt.CheckpointPolicy:
    return ckpt.CheckpointPolicy(tmp_path / "checkpoints", every=1, resume=True)


def entries(p: ckpt.CheckpointPolicy) -> list[str]:
    return sorted(x.name for x in p.directory.iterdir())


def test_a_save_writes_a_partial_tag_then_commits_it(tmp_path: Path) -> None:
    p, engine = policy(tmp_path), Engine()
    ckpt.save(engine, p, 1)
    ckpt.save(engine, p, 2)
    assert engine.saved_latest == [False, False]  # DeepSpeed's own `latest` would name a tag still being
                                                  # written
    assert entries(p) == ["latest", "step1", "step2"] and p.latest_tag() == "step2"
    assert json.loads((p.directory / "step2" / ckpt.COMMIT).read_text()) == {"step": 2, "world_size": 1}
    assert ckpt.resume(engine, p) == 2


def test_a_failure_inside_a_save_leaves_the_previous_checkpoint_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, engine = policy(tmp_path), Engine()
    ckpt.save(engine, p, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV, "raise:0:save:2")  # after this rank wrote its part, before the commit
    with pytest.raises(InjectedFault):
        ckpt.save(engine, p, 2)
    assert p.latest_tag() == "step1" and "step2.partial" in entries(p) and "step2" not in entries(p)
    assert ckpt.resume(engine, p) == 1
    monkeypatch.delenv(ENV)
    ckpt.save(engine, p, 2)  # the next save removes what the interrupted one left
    assert entries(p) == ["latest", "step1", "step2"] and p.latest_tag() == "step2"


def test_a_commit_without_every_ranks_marker_refuses(tmp_path: Path) -> None:
    p, engine = policy(tmp_path), Engine()
    ckpt.save(engine, p, 1)
    engine.save_checkpoint(str(p.directory), "step2.partial", {}, False)
    (p.directory / "step2.partial" / ".rank0.done").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match=r"rank\(s\) 1 left no marker.*latest still names"):
        ckpt.commit(p.directory, "step2", 2, world=2)
    assert p.latest_tag() == "step1"


def test_a_resave_of_a_committed_step_replaces_it_and_a_kill_between_the_renames_is_undone(
    tmp_path: Path,
) -> None:
    p, engine = policy(tmp_path), Engine()
    ckpt.save(engine, p, 1)
    ckpt.save(engine, p, 1)  # resume: never over an old run's directory saves the same tags again
    assert entries(p) == ["latest", "step1"]
    (p.directory / "step1").rename(p.directory / "step1.replaced")  # killed after setting the old one aside
    ckpt.save(engine, p, 2)
    assert entries(p) == ["latest", "step1", "step2"]


def test_latest_naming_a_missing_tag_is_a_clear_error(tmp_path: Path) -> None:
    p = policy(tmp_path)
    p.directory.mkdir()
    (p.directory / "latest").write_text("step7")
    with pytest.raises(ckpt.CheckpointError, match="names step7, which is not there"):
        ckpt.resume(Engine(), p)
