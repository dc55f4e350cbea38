"""validate on the user's data (DSF040-041, DSF620-629), torch-free: what each rule reads and where it points.

The bad corpus (tests/fixtures/bad/dsf62*.yaml) pins one finding per rule; these cover the cases it
cannot: a package that is absent, good data that must pass, and index headers of any bytes, which must
come back as a diagnosis, never as an exception.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.data_files import DataFileError, read_idx_header, read_tokenizer, text_files
from dsforge.compiler.validate import validate_file

BAD_DATA = Path(__file__).parents[2] / "fixtures" / "bad" / "data"


def job(tmp: Path, data: dict[str, Any], **extra: Any) -> Path:
    shutil.copytree(BAD_DATA, tmp / "data", dirs_exist_ok=True)
    doc = {"version": 1, "name": "t", "model": {"preset": "tiny-llama"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "training": {"data": data}, **extra}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def rules(path: Path) -> list[str]:
    return [d.rule for d in validate_file(path).diagnostics]


def test_good_text_and_chat_data_pass(tmp_path: Path) -> None:
    assert rules(job(tmp_path, {"kind": "text", "path": "data/train.jsonl", "tokenizer": "data/tok"})) == []
    assert rules(job(tmp_path, {"kind": "text", "path": "data/chat.jsonl", "tokenizer": "data/chattok",
                                "format": "chat", "valid": {"path": "data/chat.jsonl", "every": 2}})) == []
    assert rules(job(tmp_path,
                     {"kind": "text", "path": "data/*.jsonl", "tokenizer": "data/tok", "field": "text",
                                # records.jsonl has body
                                "packing": "concat"}, parallel={"pp": 2})) == ["DSF621"]


def test_a_missing_reader_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "train.parquet").write_bytes(b"PAR1 not really")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name,
                        *a: None if name == "pyarrow" else real(name, *a))
    path = job(tmp_path, {"kind": "text", "path": "pq/train.parquet", "tokenizer": "data/tok"})
    result = validate_file(path)
    assert [d.rule for d in result.diagnostics] == ["DSF626"]
    assert "pyarrow" in result.diagnostics[0].message and "dsforge[data]" in (result.diagnostics[0].fix or "")


def test_empty_files_and_absolute_paths(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    assert rules(job(tmp_path,
                     {"kind": "text", "path": "empty.jsonl", "tokenizer": "data/tok"})) == ["DSF620"]
    elsewhere = validate_file(job(tmp_path, {"kind": "text", "path": "/no/such/mount/train.jsonl",
                                             "tokenizer": "data/tok"})).diagnostics
    assert [(d.rule, d.severity.value) for d in elsewhere] == [("DSF620", "warning")]


def test_tokenizer_vocabulary_counts_added_tokens(tmp_path: Path) -> None:
    data = json.loads((BAD_DATA / "tok" / "tokenizer.json").read_text())
    data["added_tokens"] = [{"id": 999, "content": "<extra>"}]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    assert read_tokenizer(str(tmp_path), None).vocab == 1000
    with pytest.raises(DataFileError, match="no tokenizer.json"):
        read_tokenizer(str(tmp_path / "nothing"), None)


def test_text_files_of_a_directory_skip_the_cache(tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    (tmp_path / "a.txt").write_text("x\n", encoding="utf-8")
    (tmp_path / ".dsforge-cache").mkdir()
    (tmp_path / ".dsforge-cache" / "c.jsonl").write_text("{}\n", encoding="utf-8")
    assert [p.name for p in text_files(str(tmp_path)).files] == ["a.txt", "b.jsonl"]
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    # other files are not data
    assert [p.name for p in text_files(str(tmp_path)).files] == ["a.txt", "b.jsonl"]
    with pytest.raises(DataFileError, match="holds no"):
        text_files(str(tmp_path / ".dsforge-cache" / "*.txt"))


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 3), st.integers(0, 255), st.integers(0, 2**20))
def test_any_index_header_is_diagnosed_not_raised(tmp_path_factory: pytest.TempPathFactory, tail: bytes,
                                                  version: int, code: int, count: int) -> None:
    tmp = tmp_path_factory.mktemp("idx")
    (tmp / "d.bin").write_bytes(b"\0" * 8)
    (tmp / "d.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", version, code, count,
                                                                 count + 1) + tail)
    try:
        header = read_idx_header(str(tmp / "d"))
    except DataFileError as exc:
        assert exc.rule in ("DSF620", "DSF625") and exc.message
    else:
        assert version == 1 and header.sequences == count and len(tail) >= count * 12 + (count + 1) * 8


def _megatron(prefix: Path, docs: list[list[int]]) -> None:
    """An MMIDIDX pair (Megatron-Core's megatron/core/datasets/indexed_dataset.py layout), uint16 tokens."""
    prefix.with_suffix(".bin").write_bytes(b"".join(struct.pack(f"<{len(d)}H", *d) for d in docs))
    sizes = [len(d) for d in docs]
    pointers = [2 * sum(sizes[:i]) for i in range(len(docs))]
    prefix.with_suffix(".idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1)
        + struct.pack(f"<{len(docs)}i", *sizes) + struct.pack(f"<{len(docs)}q", *pointers)
        + struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def test_explain_states_tokens_and_epochs(tmp_path: Path) -> None:
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.explain.report import explain_plan
    from dsforge.explain.text import render

    _megatron(tmp_path / "a", [[1] * 100] * 10)  # 1,000 tokens: (1000 - 1) // 64 = 15 sequences of seq_len 64
    _megatron(tmp_path / "b", [[2] * 50] * 10)   # 500 tokens: 7 sequences
    path = job(tmp_path, {"kind": "megatron", "path": ["a", "b"], "weights": [3, 1]},
               )
    doc = yaml.safe_load(path.read_text())
    doc["training"].update(steps=10, global_batch=8)  # 80 sequences: 60 from a, 20 from b
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    loaded, _ = load_job(path)
    assert loaded is not None
    data = explain_plan(build_plan(loaded.spec)).summary["data"]
    a, b = data["corpora"]
    assert (a["tokens"], a["documents"], a["samples_per_epoch"]) == (1000, 10, 15)
    assert (b["tokens"], b["samples_per_epoch"]) == (500, 7)
    assert a["epochs"] == pytest.approx(60 / 15) and b["epochs"] == pytest.approx(20 / 7)
    assert "Data" in render(explain_plan(build_plan(loaded.spec)).summary)
    text = job(tmp_path, {"kind": "text", "path": "data/train.jsonl", "tokenizer": "data/tok"})
    loaded, _ = load_job(text)
    assert loaded is not None
    (row,) = explain_plan(build_plan(loaded.spec)).summary["data"]["corpora"]
    assert row["tokens"] is None and "not tokenized yet" in row["note"]
