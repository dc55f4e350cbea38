"""Training data for a dsforge job: synthetic token sequences or a memory-mapped token file, cut per rank.

Sample ``i`` is a pure function of ``i`` (and the seed), so every rank can compute exactly its own
share without a loader process or any communication, and a resumed run reads the same batches.
Optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` of the stream (G = global batch); micro-batch
``m`` of the data-parallel rank ``r`` holds samples ``s*G + (m*dp + r)*micro + [0, micro)``. All ranks
of a tensor-parallel (or pipeline, or context-parallel) group share a dp coordinate and so read the
same samples; context-parallel ranks then keep only their tokens, laid out as the attention layer
expects (dsforge.runtime.attention.sequence: load-balanced chunks for ring, contiguous for Ulysses).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from dsforge.runtime.attention.sequence import positions, shard_sequence
from dsforge.runtime.errors import DataError
from dsforge.runtime.labels import IGNORE_INDEX


class TokenSource(Protocol):
    """Anything that returns sample ``i`` as ``seq_len + 1`` int64 tokens."""

    seq_len: int

    def sample(self, index: int) -> Tensor:
        """Tokens of sample ``index``: the inputs are ``[:-1]``, the next-token targets ``[1:]``."""
        ...


class SyntheticTokens:
    """Learnable synthetic sequences: arithmetic progressions modulo the vocabulary, random start and stride.

    Uniformly random tokens would pin the loss at log(vocab); a progression is predictable from two
    tokens, so the printed loss shows the model learning.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def sample(self, index: int) -> Tensor:
        """Sample ``index``: tokens ``(a + b*t) mod vocab`` for t = 0..seq_len."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, min(self.vocab, 8), (1,), generator=g))
        return (start + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab


class TokenFile:
    """A flat array of token ids on disk (uint16 or uint32, as nanoGPT's ``train.bin``), memory-mapped.

    Sample ``i`` is the window starting at token ``(i mod n) * seq_len`` with n = (tokens - 1) // seq_len;
    nothing is read until a sample is asked for.
    """

    def __init__(self, path: str | os.PathLike[str], dtype: str, vocab: int, seq_len: int) -> None:
        self.path, self.vocab, self.seq_len = Path(path), vocab, seq_len
        if not self.path.is_file():
            raise DataError(f"training.data.path {str(path)!r} is not a file (`dsforge validate` reports "
                            f"this as DSF610; a relative path in a job "
                            f"file is taken from the job file's directory)")
        try:
            self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        except (ValueError, OSError) as exc:
            raise DataError(f"cannot map {str(path)!r} as {dtype} tokens: {exc}") from exc
        self.samples = (len(self.tokens) - 1) // seq_len
        if self.samples < 1:
            raise DataError(f"{str(path)!r} holds {len(self.tokens)} tokens, fewer than one sample of "
                            f"seq_len {seq_len} + 1")

    def sample(self, index: int) -> Tensor:
        """Tokens ``[start, start + seq_len]`` of sample ``index`` (wrapping around the file)."""
        start = (index % self.samples) * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        top = int(window.max())
        if top >= self.vocab:
            raise DataError(f"{self.path}: token id {top} near offset {start} is outside the model's "
                            f"vocabulary of {self.vocab}; the token file and model.vocab disagree")
        return window


def resolve_data_path(path: str, job_dir: str | os.PathLike[str]) -> Path:
    """The token file's path: as plan.json has it (compile made a job file's relative paths absolute against
    the job file's directory); a relative one, from a spec built in code, is taken from the job directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(job_dir) / p


@dataclass(frozen=True)
class Batch:
    """One micro-batch as this rank sees it: input ids, next-token targets and their global positions."""

    ids: Tensor
    targets: Tensor
    positions: Tensor
    tokens: int  # next-token targets of the micro-batch over the whole sequence (the loss's denominator)
    # The loss's divisor for masked targets (-100): the global batch's live targets / (dp x micro-batches per
    # rank), so the shares add up to the global token mean; None: every target is live (``tokens``).
    denominator: float | None = None

    def to(self, device: torch.device | str) -> Batch:
        """The same micro-batch on ``device``."""
        return Batch(self.ids.to(device), self.targets.to(device), self.positions.to(device), self.tokens,
                     self.denominator)


@dataclass(frozen=True)
class Sharding:
    """Where this rank sits in the data: its dp coordinate and its share of the sequence (cp)."""

    dp: int
    dp_rank: int
    cp: int = 1
    cp_rank: int = 0
    load_balanced: bool = True  # ring attention's layout; Ulysses needs contiguous shards


class Batches:
    """The micro-batches of every optimizer step for one rank."""

    def __init__(self, source: TokenSource, global_batch: int, micro_batch: int, sharding: Sharding) -> None:
        if global_batch % (micro_batch * sharding.dp):
            raise DataError(f"global_batch {global_batch} does not split into micro_batch {micro_batch} x "
                            f"dp {sharding.dp}")
        self.source, self.global_batch, self.micro, self.sharding = (
            source,
            global_batch,
            micro_batch,
            sharding,
        )
        self.grad_accum = global_batch // (micro_batch * sharding.dp)

    def samples(self, step: int, micro: int) -> list[int]:
        """Indices of the samples of micro-batch ``micro`` of optimizer step ``step`` on this rank."""
        s = self.sharding
        first = step * self.global_batch + (micro * s.dp + s.dp_rank) * self.micro
        return list(range(first, first + self.micro))

    def full(self, step: int, micro: int) -> Tensor:
        """[micro, seq_len + 1] tokens of the micro-batch before any sequence split."""
        return torch.stack([self.source.sample(i) for i in self.samples(step, micro)])

    def get(self, step: int, micro: int) -> Batch:
        """Micro-batch ``micro`` of step ``step``, cut to this rank's tokens when cp > 1."""
        if hasattr(self.source, "example"):  # dsforge.runtime.datasets: its own targets (-100) and positions
            return self._get_examples(step, micro)
        tokens = self.full(step, micro)
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        seq_len = ids.shape[1]
        s = self.sharding
        pos = positions(seq_len, s.cp_rank, s.cp, s.load_balanced) if s.cp > 1 else torch.arange(seq_len)
        if s.cp > 1:
            ids = shard_sequence(ids, s.cp_rank, s.cp, dim=1, load_balanced=s.load_balanced)
            targets = shard_sequence(targets, s.cp_rank, s.cp, dim=1, load_balanced=s.load_balanced)
        return Batch(ids.contiguous(), targets.contiguous(),
                     pos.unsqueeze(0).expand(ids.shape[0], -1).contiguous(), tokens.shape[0] * seq_len)

    def _get_examples(self, step: int, micro: int) -> Batch:
        """A micro-batch of a source with targets and positions of its own, cut to this rank's tokens when cp
        > 1 (per-document positions under cp are refused at validate time, DSF627: the CP attention ignores
        them)."""
        examples = [self.source.example(i) for i in self.samples(step, micro)]
        ids = torch.stack([e.tokens[:-1] for e in examples])
        targets = torch.stack([e.targets for e in examples])
        pos = torch.stack([e.positions for e in examples])
        whole = ids.numel()
        s = self.sharding
        if s.cp > 1:
            ids, targets, pos = (shard_sequence(x, s.cp_rank, s.cp, dim=1,
                                                load_balanced=s.load_balanced).contiguous()
                                 for x in (ids, targets, pos))
        denominator = self._denominator(step) if getattr(self.source, "masked", False) else None
        return Batch(ids, targets, pos, whole, denominator)

    def _denominator(self, step: int) -> float:
        """Live targets of the whole global batch of ``step`` over dp x micro-batches (kept for the step)."""
        memo = getattr(self, "_live", None)
        if memo is None or memo[0] != step:
            first = step * self.global_batch
            live = sum(int((self.source.example(i).targets != IGNORE_INDEX).sum())
                       for i in range(first, first + self.global_batch))
            memo = self._live = (step, max(live, 1) / (self.sharding.dp * self.grad_accum))
        return memo[1]

    def step(self, step: int) -> list[Batch]:
        """All micro-batches of one optimizer step, in order."""
        return [self.get(step, m) for m in range(self.grad_accum)]

    def global_batch_tokens(self, step: int) -> Tensor:
        """[global_batch, seq_len + 1] tokens of the whole step (what a single-process run trains on)."""
        first = step * self.global_batch
        return torch.stack([self.source.sample(i) for i in range(first, first + self.global_batch)])


def batches_for(plan: Any, groups: Any, job_dir: str | os.PathLike[str] = ".") -> Batches:
    """The job's batches for this rank: its data source, cut by the rank's dp and cp coordinates."""
    t, m = plan.spec.training, plan.spec.model
    source: TokenSource
    if t.data.kind in ("text", "megatron"):
        from dsforge.runtime.datasets import source_for

        source = source_for(t.data, m, t.seed)
    elif t.data.kind == "tokens":
        if not isinstance(t.data.path, str) or not t.data.path:
            raise DataError("training.data.kind is tokens but training.data.path is not one path")
        source = TokenFile(resolve_data_path(t.data.path, job_dir), t.data.dtype, m.vocab, m.seq_len)
    else:
        source = SyntheticTokens(m.vocab, m.seq_len, t.seed)
    kind = plan.spec.parallel.context_parallel.kind
    sharding = Sharding(groups.size("dp"), groups.index("dp"), groups.size("cp"), groups.index("cp"),
                        load_balanced=kind == "ring")
    return Batches(source, t.global_batch, t.micro_batch, sharding)
