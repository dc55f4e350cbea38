"""How far the estimates' parameter count is from the checkpoint's own (config.json, no torch): DSF180 and explain.

The job's model keys (what the estimates price) cannot state every feature of an HF family (extra
norms, per-head or whole-projection q/k norms, biases on some projections only, MLA, dense first
layers, ...); dsforge.compiler.model.hf_params counts config.json's own structure, which equals HF's
`num_parameters()` for the types it was matched on (benchmarks/hf_param_counts.py).
"""

from __future__ import annotations

from pathlib import Path

from dsforge.compiler.frontend.pretrained import PretrainedError, read_config
from dsforge.compiler.model.hf_params import hf_param_count


def param_count_note(pretrained: str | None, formula: int) -> str | None:
    """A sentence saying the estimates' count ``formula`` is approximate and by how much, None when it is exact."""
    gap = param_count_gap(pretrained, formula)
    return None if gap is None else gap[0]


def param_count_gap(pretrained: str | None, formula: int) -> tuple[str, int] | None:
    """`param_count_note`'s sentence and the difference (formula minus config.json's count), None when exact."""
    if not pretrained:
        return None
    try:
        cfg = read_config(Path(pretrained))
    except PretrainedError:
        return None
    count = hf_param_count(cfg)
    diff = formula - count.total
    share = f"{diff / count.total:+.2%}" if count.total else "n/a"
    if count.exact and diff == 0:
        return None
    if count.exact:
        return (f"the estimates count {formula:,} parameters from the model keys; config.json's model_type "
                f"{count.model_type!r} has {count.total:,} (HF's num_parameters()): parameters, memory and FLOPs "
                f"are approximate, off by {diff:+,} ({share})"), diff
    why = "; ".join(count.unpriced) or f"model_type {count.model_type!r}'s structure is not matched to HF's num_parameters()"
    return (f"config.json's parameter count is approximate ({why}): the model keys give {formula:,}, "
            f"config.json's structure {count.total:,} ({share} apart)"), diff
