"""FLOPs of a training step: model FLOPs (what MFU counts) and hardware FLOPs (what the GPUs execute).

Counts follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", sec. 5.1, eq. 3): only matrix multiplications are counted, 2 FLOPs per
multiply-add, attention scores over the full sequence (the paper's convention, which published MFU
figures use), the logit layer included, and a backward pass costs twice its forward pass. For the
GPT shape (4h MLP, no GQA) the per-step total is 72·B·s·l·h²·(1 + s/6h) + 6·B·s·h·V, which is
their eq. 3 without the recomputed forward. Generalised here to GQA (K/V projections of kv_heads
heads), SwiGLU (three h x ffn matrices) and MoE (top_k experts per token plus the router).

Recomputation adds hardware FLOPs but not model FLOPs (Korthikanti et al. 2022, sec. 6): full
recompute repeats every layer's forward, selective recompute repeats only the attention core
(QK^T, softmax, AV). MoE layers padded to capacity (DeepSpeed's top-k gating,
deepspeed/moe/sharded_moe.py) execute capacity_factor times the routed expert work.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.memo import bounded
from dsforge.compiler.estimate.stacks import profile_of
from dsforge.compiler.model.params import is_moe_layer, padded_vocab
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import Priced
from dsforge.compiler.spec.schema import AcceleratorSpec


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer layer for one token, by part."""

    attention_proj: float  # Q, K, V and output projections
    attention_core: float  # QK^T scores and the attention-weighted sum of V
    mlp: float  # the MLP, or the top_k experts of an MoE layer
    router: float = 0.0

    @property
    def total(self) -> float:
        """All forward FLOPs of the layer per token."""
        return self.attention_proj + self.attention_core + self.mlp + self.router


def _mlp_flops(model: ResolvedModel, ffn: int) -> float:
    """One MLP per token: 2 FLOPs per weight, with 2 (GELU) or 3 (SwiGLU gate, up, down) h x ffn matrices."""
    mats = 3 if model.activation == "swiglu" else 2
    return 2.0 * mats * model.hidden * ffn


def layer_forward_flops(model: ResolvedModel, moe: bool = False) -> LayerFlops:
    """Forward FLOPs per token of one layer (Narayanan et al. 2021 eq. 3 terms, extended to GQA and MoE).

    Attention: Q and O are h x (heads·head_dim), K and V are h x (kv_heads·head_dim); scores and the
    weighted sum each cost 2·s·heads·head_dim per token. MoE: top_k experts per token and an h x experts
    router.
    """
    h, s = model.hidden, model.seq_len
    q_dim, kv_dim = model.heads * model.head_dim, model.kv_heads * model.head_dim
    proj = 2.0 * (2 * h * q_dim + 2 * h * kv_dim)
    core = 4.0 * s * q_dim
    if moe and model.moe is not None:
        # every token also passes through the shared experts (Qwen2-MoE, DeepSeek)
        shared = model.moe.shared_experts * _mlp_flops(model, model.moe.shared_ffn_hidden)
        return LayerFlops(proj, core, model.moe.top_k * _mlp_flops(model, model.moe.ffn_hidden) + shared,
                          2.0 * h * model.moe.experts)
    return LayerFlops(proj, core, _mlp_flops(model, model.ffn_hidden))


def logits_forward_flops(model: ResolvedModel, tp: int = 1) -> float:
    """Forward FLOPs per token of the LM head: an h x V matmul over the (padded) vocabulary."""
    return 2.0 * model.hidden * padded_vocab(model, tp)


def _model_layer(model: ResolvedModel, moe: bool) -> float:
    """Forward model FLOPs per token of one layer: a capacity factor below 1 drops tokens, and dropped
    tokens are not computed, so the expert work counted is top_k x min(1, capacity_factor) experts; model
    FLOPs then never exceed the hardware FLOPs that pad to capacity (MFU <= HFU)."""
    f = layer_forward_flops(model, moe)
    if moe and model.moe is not None and model.moe.capacity_factor < 1:
        return f.total - f.mlp * (1 - model.moe.capacity_factor)
    return f.total


@bounded(maxsize=256)
def model_flops_per_token(model: ResolvedModel, tp: int = 1) -> float:
    """Model FLOPs per trained token, forward plus backward (3x forward; Narayanan et al. 2021 eq. 3)."""
    kinds = {moe: sum(is_moe_layer(model, i) == moe for i in range(model.layers)) for moe in (False, True)}
    layers = sum(count * _model_layer(model, moe) for moe, count in kinds.items() if count)
    return 3.0 * (layers + logits_forward_flops(model, tp))


def model_flops_per_step(plan: Priced) -> float:
    """Model FLOPs of one optimizer step: per-token FLOPs x global_batch x seq_len."""
    t, m = plan.spec.training, plan.model
    tp = plan.degrees.tp
    return model_flops_per_token(m, tp) * t.global_batch * m.seq_len


def _recompute_flops(f: LayerFlops, recompute: str) -> float:
    """Extra forward FLOPs per token that recomputation adds in the backward pass (Korthikanti et al.
    2022)."""
    if recompute == "full":
        return f.total
    if recompute == "selective":
        return f.attention_core
    return 0.0


@bounded(maxsize=256)
def _hardware_layer(model: ResolvedModel, moe: bool) -> LayerFlops:
    """Forward FLOPs per token the GPU executes: expert work padded to capacity (DeepSpeed top-k gating)."""
    f = layer_forward_flops(model, moe)
    if moe and model.moe is not None:
        return LayerFlops(f.attention_proj, f.attention_core, f.mlp * model.moe.capacity_factor, f.router)
    return f


@dataclass(frozen=True)
class ChunkFlops:
    """Hardware FLOPs one GPU executes for one micro-batch on one model chunk."""

    forward: float
    backward: float  # includes recomputation
    attention_forward: float  # the attention-core part of ``forward`` (what ring CP overlaps with)


def _unsplit_by_tp(hw: LayerFlops, moe: bool, split: bool = False) -> float:
    """Forward FLOPs per token that every TP rank runs whole: the experts and router of an MoE layer.

    dsforge's runtime keeps each expert whole on every tensor-parallel rank (DeepSpeed's MoE layer has
    no expert tensor parallelism) and, under sequence parallelism, gathers the sequence into the MoE
    block (dsforge/runtime/rewrite/sequence.py), so each TP rank routes all tokens of the micro-batch.
    A stack that splits experts over TP (``split``: Megatron-Core's expert tensor parallelism) repeats none.
    """
    return hw.mlp + hw.router if moe and not split else 0.0


def chunk_flops(plan: Priced, first_layer: int, layers: int, first: bool, last: bool) -> ChunkFlops:
    """Per-GPU hardware FLOPs of one micro-batch through layers [first_layer, first_layer + layers).

    The micro-batch's micro_batch·seq_len tokens are split over cp (each rank owns a slice of the
    sequence) and every matmul over tp (Shoeybi et al. 2019), except the MoE experts, which every TP
    rank runs whole (``_unsplit_by_tp``); the last chunk adds the logits.
    """
    model, t = plan.model, plan.spec.training
    tokens = t.micro_batch * model.seq_len / plan.degrees.cp
    split = profile_of(plan.spec.stack).experts_split_over_tp
    per_rank = tokens / plan.degrees.tp
    fwd, core, extra = _chunk_per_token(model, plan.degrees.tp, split, t.recompute,
                                        moe_phase(model, first_layer), layers, last)
    return ChunkFlops(forward=fwd * per_rank, backward=(2.0 * fwd + extra) * per_rank,
                      attention_forward=core * per_rank)


def moe_phase(model: ResolvedModel, first_layer: int) -> int:
    """Where ``first_layer`` falls in the model's dense/MoE period: two runs of layers of one length and one
    phase hold the same kinds in the same order (what per-chunk caches key on instead of the layer index)."""
    return first_layer % model.moe.every if model.moe is not None else 0


@bounded(maxsize=4096)
def _chunk_per_token(model: ResolvedModel, tp: int, split: bool, recompute: str, phase: int, layers: int,
                     last: bool) -> tuple[float, float, float]:
    """(forward, attention core, recomputed) FLOPs per split token of ``layers`` layers from period ``phase``,
    summed layer by layer (the order `chunk_flops` always summed them in, so the floats are the same)."""
    terms = {}  # one layer's (forward, core, recomputed) terms per kind: the same floats for every such layer
    for moe in (False, True):
        hw = _hardware_layer(model, moe)
        whole = _unsplit_by_tp(hw, moe, split)
        # Work every TP rank repeats counts tp times when expressed per split token.
        scale = 1.0 + (tp - 1) * whole / hw.total if hw.total else 1.0
        terms[moe] = (hw.total * scale, hw.attention_core, _recompute_flops(hw, recompute) * scale)
    fwd = core = extra = 0.0
    for i in range(phase, phase + layers):
        f, c, x = terms[is_moe_layer(model, i)]
        fwd += f
        core += c
        extra += x
    if last:
        fwd += logits_forward_flops(model, tp)
    return fwd, core, extra


def hardware_flops_per_step(plan: Priced) -> float:
    """All FLOPs the GPUs execute in one step: model FLOPs plus recomputation and MoE capacity padding."""
    model, t = plan.model, plan.spec.training
    tp = plan.degrees.tp
    split = profile_of(plan.spec.stack).experts_split_over_tp
    return _hardware_per_token(model, tp, split, t.recompute) * t.global_batch * model.seq_len


@bounded(maxsize=256)
def _hardware_per_token(model: ResolvedModel, tp: int, split: bool, recompute: str) -> float:
    """Hardware FLOPs per trained token of `hardware_flops_per_step`, summed layer by layer as it always
    was."""
    term = {}  # one layer's FLOPs per kind: the same float for every such layer
    for moe in (False, True):
        hw = _hardware_layer(model, moe)
        scale = 1.0 + (tp - 1) * _unsplit_by_tp(hw, moe, split) / hw.total if hw.total else 1.0
        term[moe] = (3.0 * hw.total + _recompute_flops(hw, recompute)) * scale
    per_token = 3.0 * logits_forward_flops(model, tp)
    for i in range(model.layers):
        per_token += term[is_moe_layer(model, i)]
    return per_token


def dense_peak_flops(accelerator: AcceleratorSpec, precision: str) -> float:
    """Dense (no sparsity) peak FLOP/s of the accelerator in the compute precision, from its data sheet."""
    if precision in ("bf16", "fp8"):  # fp8: utilisation against the bf16 peak, as Megatron and NeMo report it
        tflops = accelerator.bf16_tflops
    elif precision == "fp16":
        tflops = accelerator.fp16_tflops if accelerator.fp16_tflops is not None else accelerator.bf16_tflops
    else:
        tflops = accelerator.fp32_tflops or 0.0
    return tflops * 1e12


def fp8_peak_flops(accelerator: AcceleratorSpec) -> float:
    """Dense FP8 peak FLOP/s (0 where the accelerator states none): the rate of Transformer Engine's FP8
    GEMMs."""
    return float(getattr(accelerator, "fp8_tflops", None) or 0.0) * 1e12


def utilization(flops_per_step: float, step_s: float, gpus: int, peak_flops: float) -> float:
    """FLOPs utilisation: FLOPs per step / (step time x GPUs x peak) (MFU with model FLOPs, HFU with
    hardware)."""
    if step_s <= 0 or gpus <= 0 or peak_flops <= 0:
        return 0.0
    return flops_per_step / (step_s * gpus * peak_flops)
