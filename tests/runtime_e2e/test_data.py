"""The data pipeline on one process: which samples each rank reads, CP cuts, the memory-mapped token file.

Data-parallel ranks must split each global batch without overlap and together read exactly the
samples a single process would; context-parallel ranks must hold complementary token sets (with
their global positions) that reassemble the sequence; a token file must be read as written and
refuse ids outside the vocabulary. A failure here means parity tests could pass on wrong data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dsforge.runtime.data import Batches, DataError, Sharding, SyntheticTokens, TokenFile, resolve_data_path


def test_data_parallel_ranks_split_the_global_batch() -> None:
    source = SyntheticTokens(vocab=50, seq_len=8, seed=3)
    ranks = [Batches(source, global_batch=8, micro_batch=2,
                     sharding=Sharding(dp=2, dp_rank=r)) for r in (0, 1)]
    assert ranks[0].grad_accum == 2
    for step in (0, 5):
        seen = sorted(i for b in ranks for m in range(b.grad_accum) for i in b.samples(step, m))
        assert seen == list(range(8 * step, 8 * step + 8))
        whole = torch.cat([b.full(step, m) for m in range(2) for b in ranks])
        assert sorted(map(tuple, whole.tolist())) == sorted(map(tuple,
                                                                ranks[0].global_batch_tokens(step).tolist()))
    batch = ranks[1].get(1, 0)
    assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])  # targets are the next tokens
    assert batch.tokens == 2 * 8


@pytest.mark.parametrize("balanced", [True, False])
def test_context_parallel_ranks_hold_complementary_tokens(balanced: bool) -> None:
    source = SyntheticTokens(vocab=97, seq_len=16, seed=1)
    full = Batches(source, 2, 2, Sharding(1, 0)).get(0, 0)
    parts = [Batches(source, 2, 2,
                     Sharding(1, 0, cp=2, cp_rank=r, load_balanced=balanced)).get(0, 0) for r in (0, 1)]
    positions = torch.cat([p.positions for p in parts], dim=1)
    assert sorted(positions[0].tolist()) == list(range(16))
    for p in parts:
        assert p.ids.shape == (2, 8) and p.tokens == 2 * 16
        assert torch.equal(p.ids, full.ids.gather(1, p.positions)) and torch.equal(
            p.targets, full.targets.gather(1, p.positions)
        )
    if balanced:  # ring attention's layout: rank 0 holds the first and the last quarter
        assert parts[0].positions[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_synthetic_data_is_learnable_and_deterministic() -> None:
    a, b = SyntheticTokens(64, 12, 5), SyntheticTokens(64, 12, 5)
    s = a.sample(7)
    assert torch.equal(s, b.sample(7)) and not torch.equal(s, a.sample(8))
    steps = (s[1:] - s[:-1]) % 64
    assert len(set(steps.tolist())) == 1  # an arithmetic progression: predictable from two tokens


def test_token_file_is_memory_mapped_and_checked(tmp_path: Path) -> None:
    tokens = np.arange(0, 41, dtype=np.uint16) % 30
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    f = TokenFile(path, "uint16", vocab=30, seq_len=8)
    assert f.samples == 5 and isinstance(f.tokens, np.memmap)
    assert f.sample(1).tolist() == (np.arange(8, 17) % 30).tolist()
    assert torch.equal(f.sample(6), f.sample(1))  # wraps around
    with pytest.raises(DataError, match="outside the model's vocabulary of 20"):
        TokenFile(path, "uint16", vocab=20, seq_len=8).sample(3)
    with pytest.raises(DataError, match="fewer than one sample"):
        TokenFile(path, "uint16", vocab=30, seq_len=64)
    with pytest.raises(DataError, match="is not a file"):
        TokenFile(tmp_path / "missing.bin", "uint16", vocab=30, seq_len=8)
    assert resolve_data_path("train.bin", tmp_path) == tmp_path / "train.bin"
