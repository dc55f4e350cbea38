"""Tokenized text, cached next to the data: built once (one process, under a file lock, the others waiting),
read by every rank and every rerun through numpy memory maps.

The cache lives in ``.dsforge-cache/<key>/`` beside the data (the file's directory, the directory itself, or
the glob's fixed part). The key is a hash of the cache format, the tokenizer's files, the field and format,
and every data file's name and content, so a changed file or tokenizer builds a new cache and never reads
a stale one. Files are written into a temporary directory and renamed into place: a cache either exists
whole or not at all, and a process killed while building leaves nothing another would read.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsforge.compiler.frontend.data_files import CACHE_DIR, CACHE_FORMAT, TextFiles, cache_key, cache_root  # noqa: F401 (cache_key: re-exported)
from dsforge.runtime.errors import DataError

#: Records tokenized per call into the tokenizer (its batch encoder runs them in parallel).
CHUNK = 512


@dataclass(frozen=True)
class Tokenized:
    """A corpus as one token stream: ``tokens`` (uint32), ``starts`` (each document's first offset), optional
    ``mask`` (uint8, 1 where the token is a target that carries the loss; None: every token does)."""

    tokens: np.ndarray
    starts: np.ndarray
    mask: np.ndarray | None
    directory: Path


def open_cache(directory: Path) -> Tokenized:
    """A finished cache, memory-mapped."""
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    tokens = np.memmap(directory / "tokens.bin", dtype=np.uint32,
                       mode="r") if meta["tokens"] else np.zeros(0, np.uint32)
    mask = np.memmap(directory / "mask.bin", dtype=np.uint8,
                     mode="r") if meta["masked"] and meta["tokens"] else None
    return Tokenized(tokens, np.load(directory / "starts.npy"), mask, directory)


def tokenized(path: str, files: TextFiles, key: str, documents: Iterator[tuple[list[int], list[int] | None]],
              what: str) -> Tokenized:
    """The cache of key ``key`` under the data's directory, building it from ``documents`` if it is not there.

    ``documents`` (consumed only by the process that builds) yields each document's ids and its loss mask.
    Every process takes an exclusive lock first; the one that finds no cache builds it while the others
    wait on the lock, then find it there.
    """
    root = cache_root(path, files) / CACHE_DIR
    final = root / key
    if (final / "meta.json").is_file():
        return open_cache(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "a+")  # noqa: SIM115 (held until the cache is there)
    except OSError as exc:
        raise DataError(f"cannot write the tokenization cache in {root}: {exc}; make the data's directory "
                        "writable, or set DSFORGE_DATA_CACHE to a "
                        "writable directory (on every node)") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "meta.json").is_file():
            _build(root, final, documents, what)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return open_cache(final)


def _build(root: Path, final: Path, documents: Iterator[tuple[list[int], list[int] | None]],
           what: str) -> None:
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        starts: list[int] = []
        count, masked = 0, False
        print(f"dsforge: tokenizing {what} into {final}", file=sys.stderr, flush=True)
        with open(tmp / "tokens.bin", "wb") as tok_f, open(tmp / "mask.bin", "wb") as mask_f, \
                tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, mininterval=2.0, leave=False,
                     disable=not sys.stderr.isatty()) as bar:  # a log file gets the summary line only
            for ids, mask in documents:
                if not ids:
                    continue
                starts.append(count)
                np.asarray(ids, dtype=np.uint32).tofile(tok_f)
                if mask is not None:
                    masked = True
                np.asarray(mask if mask is not None else [1] * len(ids), dtype=np.uint8).tofile(mask_f)
                count += len(ids)
                bar.update(1)
        if not count:
            raise DataError(f"{what} holds no text to train on (every document is empty)")
        np.save(tmp / "starts.npy", np.asarray(starts, dtype=np.int64))
        if not masked:
            (tmp / "mask.bin").unlink()
        (tmp / "meta.json").write_text(json.dumps({"format": CACHE_FORMAT, "tokens": count,
                                                   "documents": len(starts),
                                                   "masked": masked}), encoding="utf-8")
        os.replace(tmp, final)
        print(f"dsforge: tokenized {len(starts):,} documents into {count:,} tokens", file=sys.stderr,
              flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
