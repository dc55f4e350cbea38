"""Closed-form pipeline bubble (Narayanan et al. 2021, sec. 2.2)."""

from __future__ import annotations


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1), and (p-1)/(v*m+p-1) when interleaved over v chunks.

    Narayanan et al. 2021 give the bubble time as (p-1)/m of the ideal time, divided by v for the
    interleaved schedule; as a fraction of the whole step that is (p-1)/v / (m + (p-1)/v).
    """
    if stages <= 1:
        return 0.0
    if micro_batches <= 0 or virtual_stages <= 0:
        raise ValueError("micro_batches and virtual_stages must be positive")
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)
