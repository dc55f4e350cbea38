"""Which parameters one rank holds: its pipeline stage's layers, split by tp, experts split by ep.

Tensor-parallel splits follow Megatron-LM (Shoeybi et al. 2019, sec. 3): column-parallel weights and
biases (QKV, MLP up/gate) and row-parallel weights (attention output, MLP down) are divided by tp;
row-parallel biases, norms, routers and learned position tables are replicated; the embedding and
LM head are vocabulary-parallel over the padded vocabulary. Expert MLPs are divided over ep (whole
experts) but not over tp: dsforge's runtime uses DeepSpeed's MoE layer, which has no expert tensor
parallelism, so every TP rank keeps its experts whole (unlike Megatron's expert_tensor_parallel_size = tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from dsforge.compiler.estimate.memo import bounded, plan_memo
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.model.params import has_bias, kv_heads_per_rank, moe_count, padded_vocab, shared_gate
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import Priced

__all__ = ["RankParams", "chunk_table", "embedding_share", "gathered_tensors", "head_share", "kind_share",
           "kind_table", "kv_heads_per_rank", "layer_kinds", "stage_chunks", "stage_share"]


@dataclass(frozen=True)
class RankParams:
    """Parameter counts one rank holds, split by how ZeRO partitions them (dense vs expert groups)."""

    dense: float
    expert: float
    largest_module: float  # the largest single layer's rank-local parameters (ZeRO-3 gathers per module)
    small: float = 0.0  # parameters in tensors at or below ZeRO-3's persistence threshold (kept whole)

    @property
    def total(self) -> float:
        """All parameters on the rank."""
        return self.dense + self.expert


def _tensor_sizes(model: ResolvedModel, moe: bool, tp: int, ep: int,
                  expert_tp: int = 1) -> tuple[list[float], list[float], int]:
    """Rank-local element counts of every parameter tensor of one layer: (dense tensors, the tensors of one
    expert, the number of experts on the rank); the experts are counted, not listed (a layer may hold
    millions).

    GPT-2-style layers (biases) fuse Q, K and V into one matrix, as HF GPT-2 and Megatron do;
    Llama-style layers keep q, k, v and o apart. Tensor boundaries matter for ZeRO-3's persistence
    threshold, which keeps whole any tensor at or below it.
    """
    h = model.hidden
    q = model.heads * model.head_dim  # heads x head_dim need not equal hidden (Qwen3, Gemma)
    kv_dim = kv_heads_per_rank(model, tp) * model.head_dim
    if has_bias(model):
        dense = [h * (q / tp + 2 * kv_dim), q / tp + 2 * kv_dim, h * q / tp, h]  # QKV, its bias, O, O bias
        dense += [h, h, h, h]  # two LayerNorms: weight and bias each
    else:
        dense = [h * q / tp, h * kv_dim, h * kv_dim, h * q / tp, h, h]  # q, k, v, o, two RMSNorms
        if model.qkv_bias:
            dense += [q / tp, kv_dim, kv_dim]  # column-parallel biases, split with their weights
    expert: list[float] = []
    experts = 0
    if moe and model.moe is not None:
        dense.append(h * model.moe.experts)  # router, replicated
        for _ in range(model.moe.shared_experts):  # shared experts: dense MLPs, split by tp like one
            dense += _mlp_sizes(model, model.moe.shared_ffn_hidden, tp)
        if model.moe.shared_experts and shared_gate(model):
            dense.append(h)  # Qwen2-MoE's shared-expert gate, replicated
        expert = _mlp_sizes(model, model.moe.ffn_hidden, expert_tp)  # dsforge: whole experts on every TP rank
        experts = model.moe.experts // max(ep, 1)
    else:
        dense += _mlp_sizes(model, model.ffn_hidden, tp)
    return dense, expert, experts


def _mlp_sizes(model: ResolvedModel, ffn: int, tp: int) -> list[float]:
    """Rank-local tensors of one MLP: each weight matrix split by tp, plus biases where present."""
    h = model.hidden
    mats = 3 if model.activation == "swiglu" else 2
    sizes = [h * ffn / tp] * mats
    if has_bias(model):
        sizes += [ffn / tp, h]
    return sizes


@bounded(maxsize=1024)
def kind_share(model: ResolvedModel, moe: bool, tp: int, ep: int, threshold: float,
               expert_tp: int = 1) -> RankParams:
    """Rank-local parameters of a dense or an MoE layer (every layer of one kind is the same); ``expert_tp``
    splits each expert's matrices (Megatron-Core's expert tensor parallelism; 1 in dsforge's runtime)."""
    dense, one_expert, experts = _tensor_sizes(model, moe, tp, ep, expert_tp)
    expert = experts * sum(one_expert)
    small = sum(n for n in dense if n <= threshold) + experts * sum(n for n in one_expert if n <= threshold)
    return RankParams(sum(dense), expert, sum(dense) + expert, small)


@bounded(maxsize=1024)
def gathered_tensors(model: ResolvedModel, moe: bool, tp: int, ep: int, threshold: float) -> tuple[int, int]:
    """(dense, expert) tensors of one layer above ZeRO-3's persistence threshold: each is fetched by its own
    all-gather call (DeepSpeed stage3 fetches parameters module by module; persistent ones stay whole)."""
    dense, one_expert, experts = _tensor_sizes(model, moe, tp, ep)
    return sum(n > threshold for n in dense), experts * sum(n > threshold for n in one_expert)


def layer_kinds(plan: Priced, stage: int) -> dict[bool, int]:
    """How many dense (False) and MoE (True) layers one rank of ``stage`` holds."""
    dense, moe = kind_table(plan)[stage]
    return {False: dense, True: moe}


def kind_table(plan: Priced) -> tuple[tuple[int, int], ...]:
    """(dense, MoE) layers of every stage, once per plan (from the partition alone: `_kind_table`)."""
    memo = plan_memo(plan)
    kinds = memo.get("kinds")
    if kinds is None:
        moe = plan.model.moe
        kinds = memo["kinds"] = _kind_table(tuple(plan.stage_layers), plan.degrees.pp,
                                            moe.every if moe else 0)
    return kinds


@bounded(maxsize=1024)
def _kind_table(layers: tuple[int, ...], pp: int, every: int) -> tuple[tuple[int, int], ...]:
    """(dense, MoE) layers of each of ``pp`` stages holding chunks ``layers`` (pipeline order), MoE layers
    every ``every`` layers (0: none), counted per chunk from its bounds (`params.moe_count`)."""
    out = []
    for chunks in _chunk_table(layers, pp):
        moe = sum(moe_count(every, first, count) for first, count in chunks)
        out.append((sum(count for _, count in chunks) - moe, moe))
    return tuple(out)


def embedding_share(model: ResolvedModel, tp: int) -> float:
    """Rank-local input embedding: the vocabulary-parallel table plus a replicated position table."""
    pos = model.seq_len * model.hidden if model.position == "learned" else 0
    return padded_vocab(model, tp) * model.hidden / tp + pos


def head_share(model: ResolvedModel, tp: int, pp: int) -> float:
    """Rank-local final norm and LM head; a tied head on a pipeline's last stage keeps its own copy.

    With pp > 1 the tied embedding lives on both the first and the last stage (DeepSpeed
    TiedLayerSpec, Megatron's shared word-embedding copy) and their gradients are all-reduced.
    """
    norm = 2 * model.hidden if has_bias(model) else model.hidden
    table = padded_vocab(model, tp) * model.hidden / tp
    if model.tied_embeddings and pp == 1:
        return norm
    return norm + table


def stage_chunks(plan: Priced, stage: int) -> list[tuple[int, int]]:
    """The (first layer, layer count) of each model chunk a pipeline rank holds, in execution order.

    Chunk j of rank i is global chunk j * pp + i (Megatron's interleaved assignment; one chunk when
    not interleaved).
    """
    return list(chunk_table(plan)[stage])


def chunk_table(plan: Priced) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`stage_chunks` of every stage, once per plan (every stage's estimate asks for them, often)."""
    memo = plan_memo(plan)
    chunks = memo.get("chunks")
    if chunks is None:
        chunks = memo["chunks"] = _chunk_table(tuple(plan.stage_layers), plan.degrees.pp)
    return chunks


@bounded(maxsize=1024)
def _chunk_table(layers: tuple[int, ...], pp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The (first layer, count) chunks of each of ``pp`` stages given the layers of every chunk (pipeline
    order; chunk j of stage s is j * pp + s): many plans share one partition."""
    starts = list(accumulate(layers, initial=0))
    return tuple(tuple((starts[c], layers[c]) for c in range(stage, len(layers), pp)) for stage in range(pp))


def stage_share(plan: Priced, stage: int, threshold: float,
                kinds: dict[bool, int] | None = None) -> RankParams:
    """All parameters one rank of ``stage`` holds: its layers, plus embedding/head where they live.

    ``kinds`` may pass `layer_kinds(plan, stage)` when the caller already has it.
    """
    d = plan.degrees
    dense, moe = (kinds.get(False, 0), kinds.get(True, 0)) if kinds else kind_table(plan)[stage]
    return _stage_share(plan.model, d.tp, d.ep, d.pp, profile_of(plan.spec.stack).experts_split_over_tp,
                        threshold, stage == 0, stage == d.pp - 1, dense, moe)


@bounded(maxsize=4096)
def _stage_share(model: ResolvedModel, tp: int, ep: int, pp: int, experts_split: bool, threshold: float,
                 first: bool, last: bool, dense_layers: int, moe_layers: int) -> RankParams:
    """`stage_share` from what it depends on: the degrees, the stage's position and its layers by kind."""
    dense = expert = small = largest = 0.0
    for moe, count in ((False, dense_layers), (True, moe_layers)):
        if count:
            s = kind_share(model, moe, tp, ep, threshold, tp if experts_split else 1)
            dense, expert, small = dense + count * s.dense, expert + count * s.expert, small + count * s.small
            largest = max(largest, s.total)
    norms = [float(model.hidden)] * (2 if has_bias(model) else 1)
    if first:
        emb = embedding_share(model, tp)
        pos = emb - padded_vocab(model, tp) * model.hidden / tp
        dense, largest = dense + emb, max(largest, emb)
        small += pos if 0 < pos <= threshold else 0.0
    if last:
        head = head_share(model, tp, pp)
        dense, largest = dense + head, max(largest, head)
        small += sum(n for n in norms if n <= threshold)
    return RankParams(dense, expert, largest, small)
