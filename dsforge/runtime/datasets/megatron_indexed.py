"""Megatron-Core indexed datasets (``<prefix>.bin`` / ``<prefix>.idx``, the MMIDIDX format), and blends of
several.

The layout, as megatron/core/datasets/indexed_dataset.py (``_IndexWriter``, ``_IndexReader``) writes and reads
it: the .idx holds the 9-byte magic ``MMIDIDX\\x00\\x00``, the version (u64, 1), the token dtype code (u8),
the sequence count S (u64), the document-index count D (u64), then S int32 sequence lengths, S int64 byte
offsets of the sequences in the .bin, and D int64 document indices (sequence index ranges, starting at 0).
The .bin is the sequences' tokens back to back. Here the .bin is read as one token stream in index order
(the samples are cut from it as from tokenized text, dsforge.runtime.datasets.packing) and the documents
start where the document indices say; nothing is added between them (Megatron's preprocess_data.py
appends the EOD token itself with --append-eod).

Blending follows Megatron's BlendedDataset: sample i goes to the dataset whose share so far lags its
weight the most (argmax of w_d * (i + 1) - taken_d; helpers.cpp build_blending_indices), a pure function
of i, and reads that dataset's next sample.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from dsforge.compiler.frontend.data_files import MEGATRON_ITEMSIZE, DataFileError, read_idx_header
from dsforge.runtime.errors import DataError


class IndexedDataset:
    """One .bin/.idx pair, memory-mapped: its token stream and each document's first token offset."""

    def __init__(self, prefix: str) -> None:
        try:
            header = read_idx_header(prefix)
        except DataFileError as exc:
            raise DataError(f"{exc.message} ({exc.rule}); fix: {exc.fix}") from exc
        self.prefix, self.dtype = prefix, np.dtype(header.dtype)
        s, d, off = header.sequences, header.documents, header.offset
        idx = np.memmap(prefix + ".idx", dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(idx, dtype="<i4", count=s, offset=off)
        self.pointers = np.frombuffer(idx, dtype="<i8", count=s, offset=off + 4 * s)
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=d, offset=off + 12 * s)
        size = MEGATRON_ITEMSIZE[header.dtype]
        expected = np.concatenate([[0], np.cumsum(self.sizes.astype(np.int64) * size)[:-1]])
        if not np.array_equal(self.pointers - self.pointers[0], expected):
            raise DataError(f"{prefix}.idx: the sequences are not stored back to back in {prefix}.bin; "
                            f"rewrite it with Megatron's preprocess_data.py")
        total = int(self.sizes.astype(np.int64).sum())
        self.tokens = np.memmap(prefix + ".bin", dtype=self.dtype.newbyteorder("<"), mode="r",
                                offset=int(self.pointers[0]), shape=(total,))
        seq_starts = expected // size
        docs = self.document_indices[:-1] if len(self.document_indices) > 1 else np.zeros(1, dtype=np.int64)
        if len(docs) and (docs.min() < 0 or docs.max() >= s):
            raise DataError(f"{prefix}.idx: a document index lies outside its {s} sequences")
        self.starts = seq_starts[docs]

    def sequence(self, i: int) -> np.ndarray:
        """The tokens of sequence ``i`` as stored."""
        a = int((self.pointers[i] - self.pointers[0]) // self.dtype.itemsize)
        return np.asarray(self.tokens[a:a + int(self.sizes[i])])


class Blend:
    """Several sources mixed by weight (Megatron's BlendedDataset order)."""

    def __init__(self, sources: list, weights: list[float]) -> None:
        if len(sources) != len(weights):
            raise DataError(f"{len(sources)} megatron prefixes but {len(weights)} weights")
        self.sources = sources
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.seq_len = sources[0].seq_len
        self._which = np.zeros(0, dtype=np.int64)
        self._local = np.zeros(0, dtype=np.int64)

    def _grow(self, upto: int) -> None:
        n = max(upto + 1, 2 * len(self._which), 1024)
        which, local = np.empty(n, np.int64), np.empty(n, np.int64)
        taken = np.zeros(len(self.sources), dtype=np.int64)
        for i in range(n):  # sequential by nature: each choice depends on the ones before
            d = int(np.argmax(self.weights * (i + 1) - taken))
            which[i], local[i] = d, taken[d]
            taken[d] += 1
        self._which, self._local = which, local

    def locate(self, index: int) -> tuple[int, int]:
        """(dataset, its sample) that blended sample ``index`` reads."""
        if index >= len(self._which):
            self._grow(index)
        return int(self._which[index]), int(self._local[index])

    def sample(self, index: int) -> Tensor:
        """Tokens of blended sample ``index``."""
        d, j = self.locate(index)
        return self.sources[d].sample(j)

    def example(self, index: int):
        """Blended sample ``index`` with its targets and positions."""
        d, j = self.locate(index)
        return self.sources[d].example(j)

    @property
    def masked(self) -> bool:
        return any(s.masked for s in self.sources)
