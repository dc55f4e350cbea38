"""Qwen4-exp's parameters beyond its Gated DeltaNet and gated attention, from config.json alone (no torch).

Its layers carry hyper-connections (``hc_count`` residual streams mixed through a rank-``hc_lowrank``
gate), attention layers a QSA indexer, and the layers ``ple_layer_ids`` names (1-based) a per-layer
embedding of hashed n-grams whose table sizes are consecutive primes after ``ngram_vocab_size_base``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from dsforge.compiler.model.hf_mixers import cfg_int


def gated_residual(cfg: dict[str, Any], hidden: int, combine: bool = True) -> int:
    """A gated residual over the streams: a grouped RMSNorm, the low-rank input mix (down, up) and, where
    it combines, the block-inject weights."""
    width = cfg_int(cfg, "hc_count", default=1) * hidden
    inject = width * cfg_int(cfg, "hc_count", default=1) if combine else 0
    return width + 2 * width * cfg_int(cfg, "hc_lowrank") + inject


def qsa_indexer(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """The QSA indexer of an attention layer: a fused q/k projection of indexer_n_heads + indexer_kv_heads
    heads of indexer_head_dim, and q and k RMSNorms over one head."""
    del index
    dim = cfg_int(cfg, "indexer_head_dim")
    return hidden * (cfg_int(cfg, "indexer_n_heads") + cfg_int(cfg, "indexer_kv_heads")) * dim + 2 * dim


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=16)
def _primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes above ``start``."""
    primes: list[int] = []
    candidate = start
    while len(primes) < count:
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    return tuple(primes)


def ple_layer(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Layer ``index``'s per-layer embedding, when ``ple_layer_ids`` names it (as index + 1): the n-gram table
    (each PLE layer's (ngram_size - 1) x heads_per_ngram heads take the next primes after the base as their
    vocabularies, padded together to make_ngram_vocab_size_divisible_by, ple_embed_dim / heads wide), key and
    value projections, three grouped norms and a depthwise convolution over the streams."""
    ids = cfg.get("ple_layer_ids") or []
    if not isinstance(ids, list) or index + 1 not in ids:
        return 0
    position = sorted(ids).index(index + 1)
    heads = (cfg_int(cfg, "ngram_size", default=2) - 1) * cfg_int(cfg, "heads_per_ngram", default=1)
    primes = _primes_after(cfg_int(cfg, "ngram_vocab_size_base") - 1, len(ids) * heads)
    sizes = primes[position * heads:(position + 1) * heads]
    divisor = cfg_int(cfg, "make_ngram_vocab_size_divisible_by", default=1) or 1
    rows = math.ceil(sum(sizes) / divisor) * divisor
    embed = cfg_int(cfg, "ple_embed_dim")
    width = cfg_int(cfg, "hc_count", default=1) * hidden
    kernel = cfg_int(cfg, "ple_conv_kernel_size", default=4)
    return rows * (embed // heads) + embed * width + embed * hidden + 3 * width + width * kernel
