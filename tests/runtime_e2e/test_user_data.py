"""The user's own data on one process: every text format tokenized by the model's tokenizer and cached,
packing with per-document positions and masks, chat loss masking, Megatron .bin/.idx read token for token,
blends, and a data order that is a pure function of the seed and the step.

A failure here means a run trains on other tokens than the files hold, attends across documents the job
says it must not, or puts the loss on prompt tokens.
"""

from __future__ import annotations

import json
import struct
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsforge.runtime.data import IGNORE_INDEX, Batches, DataError, Sharding
from dsforge.runtime.datasets import source_for
from dsforge.runtime.datasets.megatron_indexed import IndexedDataset
from dsforge.runtime.datasets.tokenizer import load_tokenizer
from tests.runtime_e2e.text_data import (
    CHAT_TEMPLATE,
    SENTENCES,
    corpus,
    pretrained_with_tokenizer,
    write_jsonl,
)


class Spec:
    """The two sections a source reads (the runtime takes them from plan.spec)."""

    def __init__(self, **data: Any) -> None:
        from dsforge.compiler.spec.schema import DataSpec, ModelSpec

        self.data = DataSpec.model_validate({"kind": "text", **data})
        self.model = ModelSpec.model_validate({"layers": 2, "hidden": 64, "heads": 4, "vocab": 320,
                                               "seq_len": 16})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pretrained_with_tokenizer(tmp_path_factory.mktemp("tiny"))


def source(model_dir: Path, seq_len: int = 16, **data: Any) -> Any:
    spec = Spec(tokenizer=str(model_dir), **data)
    model = spec.model.model_copy(update={"seq_len": seq_len})
    return source_for(spec.data, model, seed=3)


def expected_stream(model_dir: Path, texts: list[str]) -> list[int]:
    tok = load_tokenizer(str(model_dir), None)
    out: list[int] = []
    for ids in tok.encode(texts):
        out += ids + ([] if ids and ids[-1] == tok.eos else [tok.eos])
    return out


def test_jsonl_is_tokenized_by_the_models_tokenizer_and_cached(model_dir: Path, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    records = corpus(12)
    path = write_jsonl(tmp_path / "data" / "train.jsonl", records)
    s = source(model_dir, path=str(path))
    assert s.tokens.tolist() == expected_stream(model_dir, [r["text"] for r in records])
    assert len(s.starts) == 12 and s.starts[0] == 0
    assert "tokenizing" in capfd.readouterr().err
    again = source(model_dir, path=str(path))  # a rerun (or another rank) reads the cache
    assert "tokenizing" not in capfd.readouterr().err and again.tokens.tolist() == s.tokens.tolist()
    caches = list((tmp_path / "data" / ".dsforge-cache").glob("*/meta.json"))
    assert len(caches) == 1
    from dsforge.compiler.frontend.data_files import corpora  # explain finds the same cache, torch-free

    (found,) = corpora(Spec(tokenizer=str(model_dir), path=str(path)).data, None)
    assert (found.tokens, found.documents) == (len(s.tokens), 12)
    write_jsonl(path, records[:6])  # changed content: a new cache, never the stale one
    changed = source(model_dir, path=str(path))
    assert (
        len(changed.starts) == 6
        and len(list((tmp_path / "data" / ".dsforge-cache").glob("*/meta.json"))) == 2
    )


def test_every_format_reads_the_same_documents(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = corpus(10)
    texts = [r["text"] for r in records]
    want = expected_stream(model_dir, texts)
    write_jsonl(tmp_path / "jsonl" / "a.jsonl", records)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "a.json").write_text(json.dumps(records), encoding="utf-8")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"id": [r["id"] for r in records], "text": texts}),
                   tmp_path / "parquet" / "a.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    write_jsonl(tmp_path / "split" / "part-0.jsonl", records[:4])
    write_jsonl(tmp_path / "split" / "part-1.jsonl", records[4:])
    for path in ("jsonl/a.jsonl", "json/a.json", "txt/a.txt", "parquet/a.parquet", "hf", "split",
                 "split/*.jsonl"):
        got = source(model_dir, path=str(tmp_path / path)).tokens.tolist()
        assert got == want, path
    with pytest.raises(DataError, match="no field 'body'"):
        source(model_dir, path=str(tmp_path / "jsonl" / "a.jsonl"), field="body")
    with pytest.raises(DataError, match="does not exist"):
        source(model_dir, path=str(tmp_path / "missing.jsonl"))


def test_packed_documents_do_not_attend_across_each_other(model_dir: Path, tmp_path: Path) -> None:
    """The loss of a packed window with reset positions equals the loss of its documents computed apart."""
    from transformers import AutoModelForCausalLM

    path = write_jsonl(tmp_path / "d.jsonl", corpus(16))
    s = source(model_dir, seq_len=32, path=str(path))
    e = s.example(0)
    inner = [int(x) for x in s.starts if 0 < x - s.unit(0) * 32 < 32]
    assert inner, "the window should hold a document boundary"
    cut = inner[0] - s.unit(0) * 32
    assert e.positions[cut] == 0 and e.positions[cut - 1] == cut - 1 and e.positions[0] == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = e.tokens[:-1].unsqueeze(0)
    cuts = [0] + [x - s.unit(0) * 32 for x in inner] + [32]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=e.positions.unsqueeze(0), use_cache=False).logits
        apart = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in pairwise(cuts)], dim=1)
        crossing = model(input_ids=ids).logits
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)
    assert (crossing[:, cut:] - apart[:, cut:]).abs().max() > 1e-3  # without the reset the documents mix
    concat = source(model_dir, seq_len=32, path=str(path), packing="concat").example(0)
    assert concat.positions.tolist() == list(range(32)) and torch.equal(concat.tokens, e.tokens)


def test_unpacked_documents_are_padded_and_the_padding_carries_no_loss(
    model_dir: Path, tmp_path: Path
) -> None:
    records = corpus(6)
    path = write_jsonl(tmp_path / "d.jsonl", records)
    s = source(model_dir, seq_len=32, path=str(path), packing=False)
    assert s.samples == 6 and s.masked
    for i in range(6):
        e = s.example(i)
        doc = expected_stream(model_dir, [records[s.unit(i)]["text"]])
        assert e.tokens[:len(doc)].tolist() == doc[:33]
        live = (e.targets != IGNORE_INDEX).nonzero().flatten().tolist()
        assert live == list(range(min(len(doc), 33) - 1))


def test_chat_records_carry_the_loss_on_assistant_tokens_only(model_dir: Path, tmp_path: Path) -> None:
    chats = [{"messages": [{"role": "user", "content": "hello fox"},
                           {"role": "assistant", "content": "the quick brown fox"},
                           {"role": "user", "content": "thanks"},
                           {"role": "assistant", "content": "all that glitters"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", chats * 3)
    s = source(model_dir, seq_len=160, path=str(path), format="chat", packing=False)
    e = s.example(0)
    tok = load_tokenizer(str(model_dir), None)
    text = tok.render(chats[0]["messages"], generation_prompt=False)
    ids, offsets = tok.encode_rendered(text)
    assert e.tokens[:len(ids)].tolist() == ids
    # The loss positions: targets whose token lies inside an assistant turn's "content<|im_end|>\n" span.
    spans = []
    for content in ("the quick brown fox", "all that glitters"):
        a = text.index(content)
        spans.append((a, a + len(content + "<|im_end|>\n")))
    want = [j - 1 for j, (a, b) in enumerate(offsets) if j > 0 and any(x <= a and b <= y for x, y in spans)]
    live = (e.targets != IGNORE_INDEX).nonzero().flatten().tolist()
    assert live == want and live
    decoded = tok.tok.decode([ids[j + 1] for j in live], skip_special_tokens=False)
    assert "hello" not in decoded and "user" not in decoded and "the quick brown fox" in decoded
    no_template = tmp_path / "plain"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="no chat template"):
        source(no_template, seq_len=64, path=str(path), format="chat")


def test_masked_batches_divide_by_the_global_live_targets(model_dir: Path, tmp_path: Path) -> None:
    """With -100 targets the dp ranks' micro-batch losses, averaged as DeepSpeed does, are the global token
    mean."""
    path = write_jsonl(tmp_path / "d.jsonl", corpus(12))
    s = source(model_dir, seq_len=32, path=str(path), packing=False)
    ranks = [Batches(s, 4, 1, Sharding(dp=2, dp_rank=r)) for r in (0, 1)]
    logits = torch.randn(1, 32, 320, generator=torch.Generator().manual_seed(0))
    got = 0.0
    for b in ranks:
        for m in range(b.grad_accum):
            mb = b.get(0, m)
            got += float(F.cross_entropy(logits[0], mb.targets[0], ignore_index=IGNORE_INDEX,
                                         reduction="sum")) \
                / mb.denominator
    got /= 2 * 2  # DeepSpeed: the mean over dp of the mean over micro-batches
    whole = Batches(s, 4, 4, Sharding(1, 0)).get(0, 0)
    want = float(F.cross_entropy(logits.expand(4, -1, -1).reshape(-1, 320), whole.targets.reshape(-1),
                                 ignore_index=IGNORE_INDEX))
    assert got == pytest.approx(want, rel=1e-5)


def test_order_is_seeded_per_epoch_and_a_pure_function_of_the_step(model_dir: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", corpus(24))
    s = source(model_dir, seq_len=16, path=str(path))
    n = s.samples
    first_epoch = [s.unit(i) for i in range(n)]
    assert sorted(first_epoch) == list(range(n))  # every window once per epoch
    assert [s.unit(i) for i in range(n, 2 * n)] != first_epoch  # a new order each epoch
    fresh = source(model_dir, seq_len=16, path=str(path))  # a resumed run: the same batch at the same step
    a, b = Batches(s, 4, 2, Sharding(2, 1)), Batches(fresh, 4, 2, Sharding(2, 1))
    for step in (0, 3, 7):
        assert torch.equal(a.get(step, 0).ids, b.get(step, 0).ids)
    assert s.epochs(n * 3) == 3


# --- Megatron indexed datasets ------------------------------------------------------------------------------
# A reference writer of the MMIDIDX layout documented in Megatron-Core's
# megatron/core/datasets/indexed_dataset.py (class _IndexWriter, and megatron/core/datasets/readme.md): the
# index header b"MMIDIDX\x00\x00", the version as a little-endian u64 (1), the dtype code as a u8 (DType:
# uint8=1, int8=2, int16=3, int32=4, int64=5, float64=6, float32=7, uint16=8), the sequence count (u64), the
# document count (u64), then the int32 sequence lengths, the int64 byte pointers of the sequences in the .bin,
# and the int64 document indices [0, ..., sequence count]. Written here from that description, independently
# of the reader under test.

DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix: Path, documents: list[list[int]], dtype: Any = np.uint16, version: int = 1,
                   code: int | None = None) -> None:
    item = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as fh:
        fh.writelines(np.asarray(doc, dtype=dtype).tobytes() for doc in documents)
    sizes = [len(d) for d in documents]
    pointers, at = [], 0
    for n in sizes:
        pointers.append(at)
        at += n * item
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", version))
        fh.write(struct.pack("<B", DTYPE_CODES[dtype] if code is None else code))
        fh.write(struct.pack("<Q", len(sizes)))
        fh.write(struct.pack("<Q", len(sizes) + 1))
        fh.write(struct.pack(f"<{len(sizes)}i", *sizes))
        fh.write(struct.pack(f"<{len(sizes)}q", *pointers))
        fh.write(struct.pack(f"<{len(sizes) + 1}q", *range(len(sizes) + 1)))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_indexed_dataset_is_read_token_for_token(tmp_path: Path, dtype: Any) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 300, size=int(rng.integers(3, 40))).tolist() for _ in range(20)]
    write_megatron(tmp_path / "corpus_text_document", docs, dtype)
    ds = IndexedDataset(str(tmp_path / "corpus_text_document"))
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert [ds.sequence(i).tolist() for i in range(20)] == docs
    assert ds.starts.tolist() == np.cumsum([0] + [len(d) for d in docs])[:-1].tolist()
    spec = Spec(kind="megatron", path=str(tmp_path / "corpus_text_document"))
    s = source_for(spec.data, spec.model, seed=0)
    flat = [t for d in docs for t in d]
    w = s.unit(5)
    assert s.sample(5).tolist() == flat[w * 16:w * 16 + 17]


def test_megatron_blend_follows_the_weights_and_bad_headers_are_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "a", [[1] * 50] * 10)
    write_megatron(tmp_path / "b", [[2] * 50] * 10)
    spec = Spec(kind="megatron", path=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[0.75, 0.25])
    s = source_for(spec.data, spec.model, seed=0)
    picks = [s.locate(i)[0] for i in range(400)]
    assert picks.count(0) == 300 and picks.count(1) == 100
    assert set(s.sample(0).tolist()) == {1}
    write_megatron(tmp_path / "v2", [[1, 2, 3]], version=2)
    with pytest.raises(DataError, match="version 2"):
        IndexedDataset(str(tmp_path / "v2"))
    write_megatron(tmp_path / "f32", [[1, 2, 3]], code=7)
    with pytest.raises(DataError, match="dtype code 7"):
        IndexedDataset(str(tmp_path / "f32"))
    with pytest.raises(DataError, match="does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_chat_template_of_the_fixture_is_the_one_saved(model_dir: Path) -> None:
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert SENTENCES[0] in load_tokenizer("auto", str(model_dir)).tok.decode(
        load_tokenizer("auto", str(model_dir)).encode([SENTENCES[0]])[0])


def test_bad_records_are_named_by_file_and_line(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "the fox"}\n{"text": "the dog"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not JSON"):
        source(model_dir, path=str(path))
    path.write_text('{"text": "the fox"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'text' holds a int, not text"):
        source(model_dir, path=str(path))
    path.write_text('{"text": "the fox"}\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: the record has no field 'text'"):
        source(model_dir, path=str(path))
    assert not list((tmp_path / ".dsforge-cache").glob("*/meta.json"))  # a failed build leaves no cache
    path.write_text('{"text": "fox"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="fewer than one sequence"):
        source(model_dir, seq_len=64, path=str(path))
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    with pytest.raises(DataError, match="no assistant message"):
        source(model_dir, path=str(chat), format="chat")


def test_the_cache_is_built_once_while_the_others_wait(tmp_path: Path) -> None:
    """Four readers at once (flock conflicts between separate opens, as between ranks): one build, one
    cache."""
    import threading
    import time

    from dsforge.compiler.frontend.data_files import text_files
    from dsforge.runtime.datasets.tokenize_cache import tokenized

    path = write_jsonl(tmp_path / "d.jsonl", corpus(4))
    files = text_files(str(path))
    builds: list[int] = []

    def documents(n: int) -> Any:
        builds.append(n)
        time.sleep(0.3)  # long enough for every other reader to reach the lock
        yield from (([1, 2, 3, 4], None) for _ in range(3))

    results: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda n=n: results.append(tokenized(str(path), files, "k", documents(n), "d"))
        )
        for n in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(results) == 4
    assert all(r.tokens.tolist() == [1, 2, 3, 4] * 3 and r.starts.tolist() == [0, 4, 8] for r in results)
    assert not list((tmp_path / ".dsforge-cache").glob(".building-*"))


def test_packed_chat_keeps_its_mask_and_a_held_out_fraction_is_never_trained(
    model_dir: Path, tmp_path: Path
) -> None:
    chats = [{"messages": [{"role": "user", "content": SENTENCES[i % 8]},
                           {"role": "assistant", "content": SENTENCES[(i + 3) % 8]}]} for i in range(12)]
    path = write_jsonl(tmp_path / "chat.jsonl", chats)
    s = source(model_dir, seq_len=32, path=str(path), format="chat")
    assert s.masked and s.packed
    for i in range(s.samples):
        e = s.example(i)
        a = s.unit(i) * 32
        want = np.asarray(s.mask[a + 1:a + 33], dtype=bool)
        assert ((e.targets != IGNORE_INDEX).numpy() == want).all()
    text = write_jsonl(tmp_path / "t.jsonl", corpus(40))
    spec = Spec(tokenizer=str(model_dir), path=str(text), valid={"fraction": 0.25})
    train, valid = source_for(spec.data, spec.model, 3), source_for(spec.data, spec.model, 3, valid=True)
    seen_train = {train.unit(i) for i in range(train.samples)}
    seen_valid = {valid.unit(i) for i in range(valid.samples)}
    assert not seen_train & seen_valid and len(seen_train) + len(seen_valid) == (len(train.tokens) - 1) // 16


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(2, 12), st.integers(0, 5),
       st.sampled_from([True, "concat", False]))
def test_packing_arithmetic(lengths: list[int], seq_len: int, seed: int, packing: Any) -> None:
    """Windows tile the stream, each epoch visits every sample once, positions restart exactly at
    documents."""
    from dsforge.runtime.datasets.packing import PackedTokens

    starts = np.cumsum([0] + lengths[:-1])
    tokens = np.arange(sum(lengths), dtype=np.uint32) % 97
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    if packing is not False and len(tokens) < seq_len + 1:
        with pytest.raises(DataError, match="fewer than one sequence"):
            PackedTokens(tokens, starts, None, seq_len=seq_len, vocab=97, seed=seed, packing=packing, eos=0,
                         name="t")
        return
    s = PackedTokens(tokens, starts, None, seq_len=seq_len, vocab=97, seed=seed, packing=packing, eos=0,
                     name="t")
    assert sorted(s.unit(i) for i in range(s.samples)) == list(range(s.samples))
    for i in range(s.samples):
        e, u = s.example(i), s.unit(i)
        if packing is False:
            doc = tokens[starts[u]:starts[u] + lengths[u]][:seq_len + 1]
            assert e.tokens[:len(doc)].tolist() == doc.tolist()
            assert int((e.targets != IGNORE_INDEX).sum()) == len(doc) - 1
            continue
        a = u * seq_len
        assert e.tokens.tolist() == tokens[a:a + seq_len + 1].tolist()
        if packing == "concat":
            assert e.positions.tolist() == list(range(seq_len))
            continue
        docs = doc_of[a:a + seq_len]
        for j in range(seq_len):  # 0 at the window's start and at every document start, else one more
            assert e.positions[j] == (0 if j == 0 or docs[j] != docs[j - 1] else e.positions[j - 1] + 1)


def test_a_read_only_data_directory_caches_elsewhere(model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    path = write_jsonl(tmp_path / "ro" / "d.jsonl", corpus(6))
    os.chmod(tmp_path / "ro", 0o555)
    try:
        if not os.access(tmp_path / "ro", os.W_OK):  # root may write anywhere: then only the variable is
                                                     # tested
            with pytest.raises(DataError, match="DSFORGE_DATA_CACHE"):
                source(model_dir, path=str(path))
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    monkeypatch.setenv("DSFORGE_DATA_CACHE", str(tmp_path / "caches"))
    s = source(model_dir, path=str(path))
    assert len(list((tmp_path / "caches" / ".dsforge-cache").glob("*/meta.json"))) == 1 and len(s.starts) == 6
    assert not (tmp_path / "ro" / ".dsforge-cache").exists()
