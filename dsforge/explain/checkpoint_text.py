"""explain's checkpoint row: the disk bytes of one checkpoint (per rank, in total) and of the job's
retention."""

from __future__ import annotations

from typing import Any

from dsforge.explain.units import gb


def checkpoint_rows(s: dict[str, Any]) -> list[list[str]]:
    """The `checkpoint on disk` row of the summary table (none for a summary without the section)."""
    ck = s.get("checkpoint")
    if not isinstance(ck, dict):
        return []
    keep = ck["keep"]
    kept = "every one kept (training.checkpoint.keep: all)" if not isinstance(keep, int) else f"keep {keep}"
    return [["checkpoint on disk",
             (f"{gb(ck['bytes_total'])} each ({gb(ck['bytes_per_rank_max'])} on the largest rank; DeepSpeed "
             f"{gb(ck['bytes_deepspeed'])} + dsforge's copies {gb(ck['bytes_dsforge'])}); {ck['saves']} "
             f"saves, {kept}: {gb(ck['bytes_needed'])} at the peak")]]
