"""Per-rank shard shapes of one module's parameters under a variant: shape arithmetic only, no torch.

Split dimensions follow Megatron-LM (Shoeybi et al. 2019, sec. 3): a column-parallel weight is cut
along its output features, a row-parallel one along its input features, a vocab-parallel table
along the vocabulary. HF GPT-2's Conv1D stores its weight transposed (in x out), so its column cut
is dim 1 and its row cut dim 0. A fused weight (QKV) is cut block by block so that every rank keeps
its own slice of each of q, k and v; a head-split weight must give every rank whole heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Which weight dimension each variant cuts, by module kind; bias cut (0) or kept whole (None).
_WEIGHT_DIM = {
    ("column", "linear"): 0, ("column", "conv1d"): 1,
    ("row", "linear"): 1, ("row", "conv1d"): 0,
    ("vocab", "embedding"): 0, ("vocab", "linear"): 0,
}
_BIAS_DIM = {"column": 0, "row": None, "vocab": 0}


@dataclass(frozen=True)
class Heads:
    """The attention shape the plan expects: head counts, channels per head, KV replication allowed."""

    heads: int
    kv_heads: int
    head_dim: int
    replicate_kv: bool = False


@dataclass(frozen=True)
class ParamShard:
    """One parameter: its full shape, the shape one rank holds, and the dimension cut (None: whole)."""

    name: str
    shape: tuple[int, ...]
    shard: tuple[int, ...]
    dim: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return _prod(self.shape)

    @property
    def shard_numel(self) -> int:
        """Elements one rank holds."""
        return _prod(self.shard)


@dataclass
class ShardResult:
    """The shards of one module, or the problems that prevent them, plus notes worth printing."""

    params: list[ParamShard] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _cut(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if i == dim else s for i, s in enumerate(shape))


def _split_size(n: int, fused: int, tp: int, heads: str | None, spec: Heads | None,
                out: ShardResult) -> int | None:
    """Local size of a dimension of ``n`` features made of ``fused`` blocks, cut ``tp`` ways."""
    if n % fused:
        out.problems.append(f"{n} features do not form {fused} equal fused blocks")
        return None
    block = n // fused
    if heads is not None and spec is not None:
        return _split_heads(block, fused, tp, heads, spec, out)
    if block % tp:
        what = f"fused blocks of {block}" if fused > 1 else f"{n} features"
        out.problems.append(f"tp={tp} does not divide {what}")
        return None
    return n // tp


def head_unit(heads: str, head_dim: int) -> int:
    """Features of one head in a head-split weight: head_dim, or 3 x head_dim for GPT-NeoX's per-head [q k
    v]."""
    return 3 * head_dim if heads == "qkv" else head_dim


def _split_heads(block: int, fused: int, tp: int, heads: str, spec: Heads, out: ShardResult) -> int | None:
    """Local size of a head-split block: whole heads per rank, KV heads replicated where allowed."""
    label = {"q": "query", "kv": "key/value", "qkv": "[query key value]"}[heads]
    expected = spec.kv_heads if heads == "kv" else spec.heads
    unit = head_unit(heads, spec.head_dim)
    if heads == "qkv" and spec.kv_heads != spec.heads:
        out.problems.append(f"a per-head [q k v] layout has as many key/value heads as query heads, but the "
                            f"job says heads={spec.heads}, kv_heads={spec.kv_heads}")
        return None
    if block % unit or block // unit != expected:
        per = f"head_dim {spec.head_dim}" if heads != "qkv" else f"3 x head_dim {spec.head_dim}"
        out.problems.append(f"{block} features per block are not the {expected} {label} heads x {per} "
                            "the job describes")
        return None
    count = block // unit
    if count % tp == 0:
        return fused * (count // tp) * unit
    if heads == "kv" and spec.replicate_kv and tp % count == 0:
        out.notes.append(f"{count} key/value heads replicated {tp // count}x "
                         f"so each of tp={tp} ranks holds one")
        return fused * spec.head_dim
    hint = " (or set parallel.replicate_kv_heads)" if heads == "kv" and tp % count == 0 else ""
    out.problems.append(f"tp={tp} does not divide its {count} {label} "
                        f"heads: each rank must own whole heads{hint}")
    return None


def block_widths(blocks: tuple[str, ...], spec: Heads) -> list[int]:
    """Widths of a fused weight's unequal blocks named by head kind ("q": heads x head_dim, "kv": kv_heads x
    head_dim)."""
    return [(spec.heads if b == "q" else spec.kv_heads) * spec.head_dim for b in blocks]


def _split_blocks(n: int, blocks: tuple[str, ...], tp: int, spec: Heads | None,
                  out: ShardResult) -> int | None:
    """Local size of a fused dimension of unequal head blocks: each block split into whole heads on its
    own."""
    if spec is None:
        out.problems.append("unequal fused blocks need the job's head counts")
        return None
    widths = block_widths(blocks, spec)
    if sum(widths) != n:
        out.problems.append(f"{n} features are not the fused blocks {'+'.join(blocks)} = {widths} the job's "
                            f"heads describe (heads={spec.heads}, "
                            f"kv_heads={spec.kv_heads}, head_dim {spec.head_dim})")
        return None
    local = 0
    for b, w in zip(blocks, widths):
        count = w // spec.head_dim
        if count % tp:
            label = "query" if b == "q" else "key/value"
            out.problems.append(f"tp={tp} does not divide its {count} {label} "
                                f"heads: each rank must own whole heads")
            return None
        local += w // tp
    return local


def shard_norm_weight(params: dict[str, tuple[int, ...]], tp: int, heads: str, spec: Heads,
                      type_name: str) -> ShardResult:
    """Shards of a norm over a whole head-split projection (OLMo2's q_norm): its weight cut by whole heads."""
    out = ShardResult()
    if set(params) != {"weight"} or len(params["weight"]) != 1:
        out.problems.append(f"`shard_norm` needs a norm with one 1-D "
                            f"weight, not {type_name} {sorted(params)}")
        return out
    (n,) = params["weight"]
    local = _split_heads(n, 1, tp, heads, spec, out)
    if local is None:
        return out
    if local * tp != n:
        out.problems.append("`shard_norm` cannot replicate key/value heads (parallel.replicate_kv_heads)")
        return out
    out.params.append(ParamShard("weight", (n,), (local,), 0 if tp > 1 else None))
    if tp > 1:
        out.notes.append(f"mean square of the {n} features summed over the tp={tp} ranks")
    return out


def head_norm_weight(params: dict[str, tuple[int, ...]], tp: int, spec: Heads, type_name: str) -> ShardResult:
    """A per-head norm (Qwen3's q_norm over head_dim channels): replicated; the gradient is summed over TP."""
    out = ShardResult()
    if any(shape != (spec.head_dim,) for shape in params.values()) or not params:
        shapes = {k: list(v) for k, v in params.items()}
        out.problems.append(f"`head_norm` is a norm over one head's {spec.head_dim} channels; {type_name} "
                            f"holds {shapes} (a norm over the whole projection is `shard_norm`)")
        return out
    out.params = [ParamShard(n, s, s) for n, s in params.items()]
    if tp > 1:
        out.notes.append(f"each rank normalises its own heads: gradient summed over the tp={tp} ranks")
    return out


def shard_tensor_parallel(variant: str, kind: str, params: dict[str, tuple[int, ...]], tp: int,
                          fused: int = 1, heads: str | None = None, spec: Heads | None = None,
                          type_name: str = "", blocks: tuple[str, ...] = ()) -> ShardResult:
    """Shards of a column, row or vocab module (``kind``: linear, conv1d or embedding)."""
    out = ShardResult()
    wdim = _WEIGHT_DIM.get((variant, kind))
    if wdim is None:
        wanted = "an Embedding or Linear" if variant == "vocab" else "a Linear or HF Conv1D"
        out.problems.append(f"`{variant}` needs {wanted} module, not {type_name or kind}")
        return out
    extra = sorted(set(params) - {"weight", "bias"})
    if extra or "weight" not in params:
        out.problems.append(f"`{variant}` shards only `weight` and "
                            f"`bias`; this module holds {sorted(params)}")
        return out
    weight = params["weight"]
    if variant == "vocab":
        fused, heads, blocks = 1, None, ()
    if blocks and variant == "column":
        local = _split_blocks(weight[wdim], blocks, tp, spec, out)
    else:
        local = _split_size(weight[wdim], fused, tp, heads, spec, out)
    if local is None:
        if variant == "vocab":
            out.problems[-1] += " (the vocabulary: set model.vocab_multiple_of to pad it)"
        return out
    out.params.append(ParamShard("weight", weight, _cut(weight, wdim, local), wdim if tp > 1 else None))
    if "bias" in params:
        bias, bdim = params["bias"], _BIAS_DIM[variant]
        shard = bias if bdim is None else _cut(bias, bdim, local)
        out.params.append(ParamShard("bias", bias, shard, bdim if bdim is not None and tp > 1 else None))
    return out


def shard_experts(params: dict[str, tuple[int, ...]], ep: int, experts: int | None) -> ShardResult:
    """Shards of an expert module: every parameter carries the expert count first and is cut there."""
    out = ShardResult()
    counts = {shape[0] for shape in params.values() if shape}
    if not params or len(counts) != 1 or any(not shape for shape in params.values()):
        out.problems.append(f"`expert` needs parameters that all lead with the expert count; found "
                            f"{ {k: list(v) for k, v in params.items()} }")
        return out
    count = counts.pop()
    if experts is not None and count != experts:
        out.problems.append(f"holds {count} experts but the job says moe.experts={experts}")
    if count % ep:
        out.problems.append(f"ep={ep} does not divide its {count} experts: each rank must own whole experts")
    if out.problems:
        return out
    for name, shape in params.items():
        out.params.append(ParamShard(name, shape, _cut(shape, 0, count // ep), 0 if ep > 1 else None))
    out.notes.append(f"{count // ep} of {count} experts per expert-parallel rank")
    return out


def scalar_params(params: dict[str, tuple[int, ...]], tp: int, type_name: str) -> ShardResult:
    """An elementwise function's learnt scalars (Apertus' xIELU alpha_p, alpha_n) applied to split channels:
    replicated; the gradient is summed over TP."""
    out = ShardResult()
    if not params or any(math.prod(shape) != 1 for shape in params.values()):
        shapes = {k: list(v) for k, v in params.items()}
        out.problems.append(f"`scalars` keeps learnt scalars only; {type_name} holds {shapes}")
        return out
    out.params = [ParamShard(n, s, s) for n, s in params.items()]
    if tp > 1:
        out.notes.append(f"applied to this rank's channels: gradient summed over the tp={tp} ranks")
    return out


def replicated(params: dict[str, tuple[int, ...]]) -> ShardResult:
    """Every parameter kept whole."""
    return ShardResult(params=[ParamShard(n, s, s) for n, s in params.items()])
