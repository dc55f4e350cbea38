"""How far the estimates' parameter count is from the checkpoint's own (config.json, no torch): DSF180 and
explain.

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
    """A sentence saying the estimates' count ``formula`` is approximate and by how much, None when it is
    exact."""
    gap = param_count_gap(pretrained, formula)
    return None if gap is None else gap[0]


def param_count_gap(pretrained: str | None, formula: int) -> tuple[str, int] | None:
    """`param_count_note`'s sentence and the difference (formula minus config.json's count), None when
    exact."""
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
                f"{count.model_type!r} has {count.total:,} (HF's num_parameters()): parameters, memory and "
                f"FLOPs are approximate, off by {diff:+,} ({share})"), diff
    why = "; ".join(count.unpriced) or (f"model_type {count.model_type!r}'s structure "
                                        f"is not matched to HF's num_parameters()")
    return (f"config.json's parameter count is approximate ({why}): the model keys give {formula:,}, "
            f"config.json's structure {count.total:,} ({share} apart)"), diff


def attention_core_gaps(pretrained: str | None, seq_len: int, heads: int, head_dim: int,
                        layers: int) -> list[tuple[str, float]]:
    """(what, model FLOPs per token the estimates miss; negative: they overcount) for the attention features
    of config.json the cost model prices as plain attention of ``heads`` x ``head_dim`` over ``seq_len``."""
    if not pretrained:
        return []
    try:
        cfg = read_config(Path(pretrained))
    except PretrainedError:
        return []
    out: list[tuple[str, float]] = []
    dims = [cfg.get(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    ints = [x for x in dims if isinstance(x, int) and not isinstance(x, bool)]
    if len(ints) == len(dims):
        nope, rope, v_dim = ints[1], ints[2], ints[3]
        # scores over nope + rope channels, values over v_head_dim, where the estimates take head_dim for both
        gap = 3.0 * layers * 2 * seq_len * heads * (nope + rope + v_dim - 2 * head_dim)
        what = (f"MLA attention (scores over {nope + rope} channels, "
                f"values over {v_dim}, priced as {head_dim} each)")
        out.append((what, gap))
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        linear = sum(1 for k in kinds if k not in ("full_attention", "sliding_attention",
                                                   "chunked_attention"))
        if linear:  # priced as softmax attention over the whole sequence: at most this much too many
            what = (f"{linear} of {len(kinds)} layers are not softmax attention ({sorted(set(kinds))}), "
                    f"priced as full attention (their own linear-time cost not counted)")
            out.append((what, -3.0 * linear * 4 * seq_len * heads * head_dim))
    return out
