"""Samples cut from a token stream: packed windows (documents back to back, EOS between them) or one document
per sample, in an order drawn from the seed, each a pure function of its index (so a resumed run reads on).

Packed (``packing: true`` or ``concat``): the stream's windows ``[w*seq_len, w*seq_len + seq_len]``, w < n
with n = (tokens - 1) // seq_len, visited in a fresh permutation of the n windows every epoch (numpy's PCG64
seeded by (seed, epoch)). With ``packing: true`` the positions restart at 0 at every document's first token
(Megatron's reset_position_ids; the first, partial document of a window starts at 0 as well), and the HF model
builds its causal mask per document from them (transformers' find_packed_sequence_indices), so attention does
not cross documents. ``concat`` keeps positions 0..seq_len-1 and full causal attention. Unpacked (``packing:
false``): sample i is one document, cut to seq_len + 1 tokens and padded with EOS; the padding's targets are
ignored (-100).

A loss mask (chat data) turns the targets of masked tokens into -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from dsforge.runtime.errors import DataError
from dsforge.runtime.labels import IGNORE_INDEX


@dataclass(frozen=True)
class Example:
    """One sample: ``seq_len + 1`` tokens, the ``seq_len`` next-token targets (-100: no loss), positions."""

    tokens: Tensor
    targets: Tensor
    positions: Tensor


class PackedTokens:
    """Samples of a tokenized stream (see the module docstring); ``windows`` restricts it to a range of
    them."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray | None, *, seq_len: int,
                 vocab: int, seed: int, packing: bool | str, eos: int, name: str,
                 windows: tuple[float, float] = (0.0, 1.0)) -> None:
        self.tokens, self.starts, self.mask = tokens, np.asarray(starts, dtype=np.int64), mask
        self.seq_len, self.vocab, self.seed, self.eos, self.name = seq_len, vocab, seed, eos, name
        self.packed, self.reset = packing is not False, packing is True
        self.masked = mask is not None or not self.packed
        total = (len(tokens) - 1) // seq_len if self.packed else len(self.starts)
        lo, hi = int(total * windows[0]), int(total * windows[1])
        self.first, self.samples = lo, hi - lo
        if self.samples < 1:
            what = (f"{len(tokens)} tokens, fewer than one sequence of seq_len {seq_len} + 1" if self.packed
                    else "no document")
            raise DataError(
                f"{name} holds {what}" + (" in this share of it" if windows != (0.0, 1.0) else "")
            )
        self._ends = np.append(self.starts[1:], len(tokens))

    @lru_cache(maxsize=4)  # noqa: B019 (a few epochs are live at a time; the source lives as long as the run)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.samples)

    def unit(self, index: int) -> int:
        """The window (packed) or document (unpacked) that sample ``index`` reads."""
        epoch, k = divmod(index, self.samples)
        return self.first + int(self._order(epoch)[k])

    def epochs(self, samples: int) -> float:
        """How many passes over the data ``samples`` samples make."""
        return samples / self.samples

    def sample(self, index: int) -> Tensor:
        """The ``seq_len + 1`` tokens of sample ``index``."""
        return self.example(index).tokens

    def example(self, index: int) -> Example:
        """Sample ``index`` with its targets and positions."""
        n = self.seq_len
        u = self.unit(index)
        if self.packed:
            a = u * n
            window = np.asarray(self.tokens[a:a + n + 1], dtype=np.int64)
            live = (
                np.ones(n, dtype=bool)
                if self.mask is None
                else np.asarray(self.mask[a + 1 : a + n + 1], dtype=bool)
            )
        else:
            a, b = int(self.starts[u]), int(self._ends[u])
            doc = np.asarray(self.tokens[a:min(b, a + n + 1)], dtype=np.int64)
            window = np.full(n + 1, self.eos, dtype=np.int64)
            window[:len(doc)] = doc
            live = np.zeros(n, dtype=bool)
            live[: len(doc) - 1] = (
                True if self.mask is None else np.asarray(self.mask[a + 1 : a + len(doc)], dtype=bool)
            )
        top = int(window.max())
        if top >= self.vocab:
            raise DataError(f"{self.name}: token id {top} near offset {a} is outside the model's vocabulary "
                            f"of {self.vocab}; the tokenizer and model.vocab disagree (DSF623)")
        tokens = torch.from_numpy(window)
        targets = tokens[1:].clone()
        targets[~torch.from_numpy(live)] = IGNORE_INDEX
        return Example(tokens, targets, torch.from_numpy(self._positions(a) if self.packed and self.reset
                                                         else np.arange(n, dtype=np.int64)))

    def _positions(self, a: int) -> np.ndarray:
        """Positions of the window at offset ``a``: 0 at its start and at every document start inside it."""
        n = self.seq_len
        lo, hi = np.searchsorted(self.starts, [a + 1, a + n], side="left")
        pos = np.arange(n, dtype=np.int64)
        for s in self.starts[lo:hi]:
            pos[s - a:] -= pos[s - a]
        return pos
