"""Manifests, retention and a full disk on the checkpoint commit, with a stand-in engine (no DeepSpeed).

tests/runtime_e2e/test_machine_faults.py does the same on real `dsforge run` jobs; here every branch
runs in milliseconds: a flipped byte, a truncated, missing or added file, a fallback past several
damaged checkpoints, `keep` never deleting what `latest` names, ENOSPC inside a save.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.runtime import checkpoint as ckpt
from dsforge.runtime import checkpoint_manifest as manifest
from dsforge.runtime.disk_space import DiskFullError, is_disk_full
from dsforge.runtime.retention import complete_steps, obsolete
from tests.runtime.test_checkpoint_commit import Engine


class BigEngine(Engine):
    """Writes a second, larger file per save, as DeepSpeed writes model and optimizer files."""

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any],
                        save_latest: bool) -> None:
        super().save_checkpoint(save_dir, tag, client_state, save_latest)
        (Path(save_dir) / tag / "optim_states.pt").write_bytes(bytes(range(256)) * 64)


def policy(tmp_path: Path, **kw: Any) -> ckpt.CheckpointPolicy:
    return ckpt.CheckpointPolicy(tmp_path / "checkpoints", every=1, resume=True, **kw)


def flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_commit_writes_a_manifest_of_every_file(tmp_path: Path) -> None:
    p = policy(tmp_path)
    ckpt.save(BigEngine(), p, 1)
    doc = json.loads((p.directory / "step1" / manifest.MANIFEST).read_text())
    assert doc["algorithm"] == manifest.XXH3  # xxhash comes with the runtime extra
    assert set(doc["files"]) == {"mp_rank_00_model_states.pt", "optim_states.pt", ckpt.COMMIT}
    assert doc["files"]["optim_states.pt"]["size"] == 256 * 64
    assert not list((p.directory / "step1").glob(".rank*.digests.json"))  # shares merged and removed
    assert manifest.check(p.directory / "step1") == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "add"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    p, engine = policy(tmp_path), BigEngine()
    ckpt.save(engine, p, 1)
    ckpt.save(engine, p, 2)
    target = p.directory / "step2" / "optim_states.pt"
    if damage == "flip":
        flip(target)
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "delete":
        target.unlink()
    else:
        target = p.directory / "step2" / "stray.bin"
        target.write_bytes(b"x")
    with pytest.raises(manifest.DamagedCheckpoint, match=rf"DSF615: .*step2 is damaged: "
                                                         rf"{target}.*if_damaged: fall_back"):
        ckpt.resume(engine, p)


def test_fall_back_skips_damaged_checkpoints_to_the_newest_intact_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dsforge.runtime.resume_check import RESUME_RECORD

    p, engine = policy(tmp_path, fall_back=True), BigEngine()
    for step in (1, 2, 3):
        ckpt.save(engine, p, step)
    flip(p.directory / "step3" / "mp_rank_00_model_states.pt", 3)
    (p.directory / "step2" / "optim_states.pt").write_bytes(b"")
    assert ckpt.resume(engine, p) == 1
    out = capsys.readouterr().out
    assert (
        "step3 is damaged" in out and "resuming from the newest intact checkpoint" in out and "step1" in out
    )
    assert RESUME_RECORD["tag"] == "step1" and [s["tag"] for s in RESUME_RECORD["skipped"]] == [
        "step3",
        "step2",
    ]
    flip(p.directory / "step1" / "optim_states.pt")
    with pytest.raises(manifest.DamagedCheckpoint, match="no older checkpoint there is intact"):
        ckpt.resume(engine, p)


def test_without_xxhash_the_manifest_is_blake2b_and_still_catches_a_flip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "default_algorithm", lambda: manifest.BLAKE2B)
    p, engine = policy(tmp_path), BigEngine()
    ckpt.save(engine, p, 1)
    doc = json.loads((p.directory / "step1" / manifest.MANIFEST).read_text())
    assert doc["algorithm"] == manifest.BLAKE2B and len(doc["files"][ckpt.COMMIT]["digest"]) == 64
    monkeypatch.undo()  # the check follows the manifest's algorithm, not the installed default
    assert manifest.check(p.directory / "step1") == []
    flip(p.directory / "step1" / "optim_states.pt", 5)
    assert "differs from its digest" in manifest.check(p.directory / "step1")[0]


def test_a_checkpoint_without_a_manifest_loads_with_a_note(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    p, engine = policy(tmp_path), BigEngine()
    ckpt.save(engine, p, 1)
    (p.directory / "step1" / manifest.MANIFEST).unlink()  # as a dsforge before manifests saved it
    assert ckpt.resume(engine, p) == 1
    assert "has no integrity manifest" in capsys.readouterr().out


def test_an_unreadable_manifest_is_damage(tmp_path: Path) -> None:
    p, engine = policy(tmp_path), BigEngine()
    ckpt.save(engine, p, 1)
    (p.directory / "step1" / manifest.MANIFEST).write_text("{not json")
    with pytest.raises(manifest.DamagedCheckpoint, match="its manifest .* cannot be read"):
        ckpt.resume(engine, p)


def test_keep_leaves_the_newest_n_and_never_what_latest_names(tmp_path: Path) -> None:
    p, engine = policy(tmp_path, keep=2), Engine()
    for step in range(1, 6):
        ckpt.save(engine, p, step)
    assert complete_steps(p.directory) == [4, 5] and p.latest_tag() == "step5"
    ckpt.save(engine, p, 3)  # a resave below the newest (resume: never over the directory): 5 and 4 are not
                             # older
    assert complete_steps(p.directory) == [3, 4, 5] and p.latest_tag() == "step3"
    q = policy(tmp_path / "all")
    for step in range(1, 4):
        ckpt.save(engine, q, step)
    assert complete_steps(q.directory) == [1, 2, 3]  # keep: all


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, 60), max_size=12), st.integers(1, 60), st.integers(1, 8))
def test_retention_deletes_only_older_ones_and_keeps_n(steps: set[int], latest: int, keep: int) -> None:
    have = sorted(steps | {latest})
    gone = obsolete(have, latest, keep)
    assert latest not in gone and all(s < latest for s in gone)
    left_below = [s for s in have if s <= latest and s not in gone]
    assert len(left_below) == min(keep, len([s for s in have if s <= latest]))
    assert not gone or max(gone) < min(s for s in left_below)  # the oldest go first


def test_the_digest_shares_cover_every_file_once() -> None:
    sizes = {f"f{i}": (i * 7919) % 1000 for i in range(37)}
    parts = [manifest.share(sizes, r, 5) for r in range(5)]
    assert sorted(n for part in parts for n in part) == sorted(sizes)
    loads = [sum(sizes[n] for n in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes.values())


class FullDisk(Engine):
    """Fails inside save_checkpoint as torch.save does on a full disk, after writing part of the tag."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any],
                        save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "half.pt").write_bytes(b"x" * 100)
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 6049088 vs 6048976"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        ValueError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ],
)
def test_a_full_disk_inside_a_save_is_one_line_and_leaves_latest(tmp_path: Path, exc: BaseException) -> None:
    p = policy(tmp_path)
    ckpt.save(BigEngine(), p, 1)
    with pytest.raises(DiskFullError) as info:
        ckpt.save(FullDisk(exc), p, 2)
    text = str(info.value)
    assert text.startswith("DSF616: the file system of") and "\n" not in text
    size = json.loads((p.directory / "step1" / manifest.MANIFEST).read_text())["bytes"]
    assert (
        f"step2.partial, removed) needs {size:,} bytes (as step1 measured)" in text
        and "bytes are free" in text
    )
    assert p.latest_tag() == "step1" and not (p.directory / "step2.partial").exists()


def test_other_save_failures_are_not_called_a_full_disk() -> None:
    assert not is_disk_full(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
