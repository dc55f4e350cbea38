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

from dsforge.compiler.params import has_bias, is_moe_layer, padded_vocab, shared_gate
from dsforge.compiler.plan import Plan
from dsforge.compiler.resolved import ResolvedModel


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


def kv_heads_per_rank(model: ResolvedModel, tp: int) -> float:
    """KV heads a tp rank holds: kv_heads / tp, or one replicated head when tp exceeds kv_heads."""
    kv = model.kv_heads
    return kv / tp if kv >= tp else 1.0


def _tensor_sizes(model: ResolvedModel, moe: bool, tp: int, ep: int,
                  expert_tp: int = 1) -> tuple[list[float], list[float], int]:
    """Rank-local element counts of every parameter tensor of one layer: (dense tensors, the tensors of one
    expert, the number of experts on the rank); the experts are counted, not listed (a layer may hold millions).

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


def kind_share(model: ResolvedModel, moe: bool, tp: int, ep: int, threshold: float, expert_tp: int = 1) -> RankParams:
    """Rank-local parameters of a dense or an MoE layer (every layer of one kind is the same); ``expert_tp``
    splits each expert's matrices (Megatron-Core's expert tensor parallelism; 1 in dsforge's runtime)."""
    dense, one_expert, experts = _tensor_sizes(model, moe, tp, ep, expert_tp)
    expert = experts * sum(one_expert)
    small = sum(n for n in dense if n <= threshold) + experts * sum(n for n in one_expert if n <= threshold)
    return RankParams(sum(dense), expert, sum(dense) + expert, small)


def gathered_tensors(model: ResolvedModel, moe: bool, tp: int, ep: int, threshold: float) -> tuple[int, int]:
    """(dense, expert) tensors of one layer above ZeRO-3's persistence threshold: each is fetched by its own
    all-gather call (DeepSpeed stage3 fetches parameters module by module; persistent ones stay whole)."""
    dense, one_expert, experts = _tensor_sizes(model, moe, tp, ep)
    return sum(n > threshold for n in dense), experts * sum(n > threshold for n in one_expert)


def layer_kinds(plan: Plan, stage: int) -> dict[bool, int]:
    """How many dense (False) and MoE (True) layers one rank of ``stage`` holds."""
    model = plan.model
    counts = {False: 0, True: 0}
    for first, count in stage_chunks(plan, stage):
        for i in range(first, first + count):
            counts[is_moe_layer(model, i)] += 1
    return counts


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


def stage_chunks(plan: Plan, stage: int) -> list[tuple[int, int]]:
    """The (first layer, layer count) of each model chunk a pipeline rank holds, in execution order.

    Chunk j of rank i is global chunk j * pp + i (Megatron's interleaved assignment; one chunk when
    not interleaved).
    """
    assert plan.degrees is not None
    pp = plan.degrees.pp
    starts = _starts(plan.stage_layers)
    return [(starts[c], plan.stage_layers[c]) for c in range(stage, len(plan.stage_layers), pp)]


_last_starts: tuple[list[int], list[int]] | None = None


def _starts(layers: list[int]) -> list[int]:
    """First layer of every chunk; the last partition's are kept, since every stage of a plan asks for them
    (recomputing them per stage made 1,024 stages of 9 chunks cost seconds)."""
    global _last_starts
    if _last_starts is None or _last_starts[0] is not layers:
        _last_starts = (layers, list(accumulate(layers, initial=0)))
    return _last_starts[1]


def _experts_split(plan: Plan) -> bool:
    from dsforge.compiler.estimate.stacks import profile_of  # stacks imports activations, which imports this

    return profile_of(plan.spec.stack).experts_split_over_tp


def stage_share(plan: Plan, stage: int, threshold: float, kinds: dict[bool, int] | None = None) -> RankParams:
    """All parameters one rank of ``stage`` holds: its layers, plus embedding/head where they live.

    ``kinds`` may pass `layer_kinds(plan, stage)` when the caller already has it.
    """
    assert plan.degrees is not None
    d, model = plan.degrees, plan.model
    dense = expert = small = largest = 0.0
    for moe, count in (kinds or layer_kinds(plan, stage)).items():
        if count:
            s = kind_share(model, moe, d.tp, d.ep, threshold, d.tp if _experts_split(plan) else 1)
            dense, expert, small = dense + count * s.dense, expert + count * s.expert, small + count * s.small
            largest = max(largest, s.total)
    norms = [float(model.hidden)] * (2 if has_bias(model) else 1)
    if stage == 0:
        emb = embedding_share(model, d.tp)
        pos = emb - padded_vocab(model, d.tp) * model.hidden / d.tp
        dense, largest = dense + emb, max(largest, emb)
        small += pos if 0 < pos <= threshold else 0.0
    if stage == d.pp - 1:
        head = head_share(model, d.tp, d.pp)
        dense, largest = dense + head, max(largest, head)
        small += sum(n for n in norms if n <= threshold)
    return RankParams(dense, expert, largest, small)
