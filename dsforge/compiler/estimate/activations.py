"""Activation memory: the tensors a transformer layer saves for backward, per micro-batch.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4:
a GPT layer saves s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations (eq. 1); with tensor
parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t)) (eq. 2); with sequence parallelism all of it is divided
by t (eq. 3); selective recomputation drops the 5*a*s/h attention-score term (eq. 4); full
recomputation keeps only the layer input, 2*s*b*h (/t with sequence parallelism). This module
derives the same terms tensor by tensor so that it also covers GQA (K/V narrower than Q), SwiGLU
(gate, up, SiLU output and product saved), any ffn width, fp32 activations, context parallelism
(s/cp local tokens attending to all s keys), MoE layers and fused attention.

Assumptions, stated: GPT-2-style layers (biases, LayerNorm) carry dropout after attention scores,
attention output and MLP (Megatron's GPT default), Llama-style ones none. A fused attention kernel
(FlashAttention; assumed on every accelerator except the CPU) saves Q, K, V, the output and a fp32
log-sum-exp per head and token instead of the score matrices. RoPE is assumed fused (no extra saved
tensors). LayerNorm saves fp32 mean and rstd per token, RMSNorm an fp32 rstd. On an accelerator the
dropout kernel is fused and keeps a one-byte mask and the masked softmax is fused (Megatron's
scaled_upper_triang_masked_softmax); on the CPU `at::dropout` multiplies by a noise tensor of the
activation dtype and `masked_fill` keeps the boolean causal mask (s x s per layer). Measured on a tiny GPT on the CPU, this count matches autograd's saved tensors exactly
(tests/test_memory_measured.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.shares import kv_heads_per_rank
from dsforge.compiler.params import has_bias
from dsforge.compiler.schema import ModelSpec

FP32 = 4
MASK = 1  # a dropout mask is one byte per element in PyTorch


@dataclass(frozen=True)
class ActivationShape:
    """What sizes one rank's activations: micro-batch, sequence, degrees, precision and kernels."""

    micro_batch: int
    seq_len: int
    tp: int
    cp: int
    sequence_parallel: bool
    element_bytes: int  # 2 for bf16/fp16 activations, 4 for fp32
    fused_attention: bool  # FlashAttention-style kernel: no score matrices saved
    fused_kernels: bool = True  # GPU kernels: 1-byte dropout masks, masked softmax without a saved mask

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch held by this rank (the sequence is split over cp)."""
        return self.micro_batch * self.seq_len / self.cp

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a saved dropout mask."""
        return MASK if self.fused_kernels else self.element_bytes

    @property
    def sp_div(self) -> int:
        """Divisor of the norm/dropout region: tp with sequence parallelism, else 1 (replicated)."""
        return self.tp if self.sequence_parallel else 1


def has_dropout(model: ModelSpec) -> bool:
    """GPT-2-style models train with dropout (Megatron GPT default 0.1); Llama-style ones without."""
    return has_bias(model)


def attention_terms(model: ModelSpec, a: ActivationShape) -> dict[str, float]:
    """Bytes one layer's attention block saves for backward (one micro-batch), by tensor group."""
    h, t, e, n = model.hidden, a.tp, a.element_bytes, a.tokens
    kv_dim = kv_heads_per_rank(model, t) * (h // model.heads)
    heads = model.heads / t
    norm_stats = (2 if has_bias(model) else 1) * FP32
    terms = {
        "norm": n * (h * e + norm_stats) / a.sp_div,  # norm input and its fp32 statistics
        "qkv_input": n * h * e / a.sp_div,
        "q_k_v": n * (h / t + 2 * kv_dim) * e,
        "attn_output": n * h / t * e,  # input of the output projection (also the fused kernel's output)
    }
    if a.fused_attention:
        terms["softmax_lse"] = n * heads * FP32
    else:
        scores = n * heads * a.seq_len  # each local query row against all s keys
        terms["scores"] = scores * e  # softmax output
        if has_dropout(model):
            terms["scores"] += scores * (a.mask_bytes + e)  # dropout mask and dropout output
        if not a.fused_kernels:  # masked_fill keeps the boolean mask; a fused masked softmax does not
            terms["causal_mask"] = a.seq_len / a.cp * a.seq_len * MASK
    if has_dropout(model):
        terms["dropout_masks"] = n * h * a.mask_bytes / a.sp_div
    return terms


def _mlp_inner(model: ModelSpec, ffn: int, t: int, e: int) -> float:
    """Bytes per token an MLP saves inside its tp-split region: GELU input and output, or SwiGLU's
    gate, up, SiLU output and product."""
    per = 4 if model.activation == "swiglu" else 2
    return per * ffn / t * e


def mlp_terms(model: ModelSpec, a: ActivationShape, moe: bool) -> dict[str, float]:
    """Bytes one layer's MLP block (dense or MoE) saves for backward (one micro-batch)."""
    h, t, e, n = model.hidden, a.tp, a.element_bytes, a.tokens
    norm_stats = (2 if has_bias(model) else 1) * FP32
    terms = {"norm": n * (h * e + norm_stats) / a.sp_div, "mlp_input": n * h * e / a.sp_div}
    if moe and model.moe is not None:
        m = model.moe
        routed = n * m.top_k * m.capacity_factor  # token copies processed by the experts on this rank
        ffn = m.ffn_hidden or model.ffn_hidden or 4 * h
        terms["router"] = n * m.experts * e + n * m.top_k * (e + 8)  # probabilities, top-k weights, indices
        terms["experts"] = routed * (2 * h * e + _mlp_inner(model, ffn, t, e))  # input, inner, output
    else:
        terms["mlp_inner"] = n * _mlp_inner(model, model.ffn_hidden or 4 * h, t, e)
    if has_dropout(model):
        terms["dropout_masks"] = n * h * a.mask_bytes / a.sp_div
    return terms


def layer_terms(model: ModelSpec, a: ActivationShape, moe: bool) -> dict[str, float]:
    """All bytes one layer saves for backward with no recomputation, by tensor group."""
    out: dict[str, float] = {}
    for name, value in [*(("attn." + k, v) for k, v in attention_terms(model, a).items()),
                        *(("mlp." + k, v) for k, v in mlp_terms(model, a, moe).items())]:
        out[name] = value
    return out


def layer_bytes(model: ModelSpec, a: ActivationShape, moe: bool, recompute: str) -> float:
    """Bytes one layer keeps for backward under a recompute policy (Korthikanti et al. 2022, sec. 4-5).

    none: every saved tensor; selective: all but the attention scores (eq. 4); full: only the layer
    input, s*b*h (divided by t with sequence parallelism, as Megatron stores it sharded).
    """
    if recompute == "full":
        return a.tokens * model.hidden * a.element_bytes / a.sp_div
    terms = layer_terms(model, a, moe)
    if recompute == "selective":
        terms.pop("attn.scores", None)
        terms.pop("attn.causal_mask", None)
    return sum(terms.values())


def recompute_working_set(model: ModelSpec, a: ActivationShape, moe: bool, recompute: str) -> float:
    """Bytes rematerialised for one layer during backward: the dropped tensors of one layer."""
    if recompute == "none":
        return 0.0
    full = sum(layer_terms(model, a, moe).values())
    return full - layer_bytes(model, a, moe, recompute)


def embedding_bytes(model: ModelSpec, a: ActivationShape) -> float:
    """Bytes the input embedding saves: int64 token (and position) ids, and a dropout mask for GPT-2
    style models."""
    saved = a.tokens * 8
    if model.position == "learned":
        saved += a.seq_len / a.cp * 8
    if has_dropout(model):
        saved += a.tokens * model.hidden * a.mask_bytes / a.sp_div
    return saved


def head_bytes(model: ModelSpec, a: ActivationShape) -> float:
    """Bytes the final norm and LM head save: the norm input and statistics and the head's input."""
    norm_stats = (2 if has_bias(model) else 1) * FP32
    h, e = model.hidden, a.element_bytes
    return a.tokens * (h * e + norm_stats) / a.sp_div + a.tokens * h * e


def logits_bytes(model: ModelSpec, a: ActivationShape, vocab: int) -> tuple[float, float]:
    """(saved, transient) bytes of the loss: fp32 log-probabilities and int64 targets kept for
    backward, and the logits in the compute dtype alive while the loss is formed; the vocabulary is
    split over tp (vocabulary-parallel cross-entropy)."""
    cells = a.tokens * vocab / a.tp
    return cells * FP32 + a.tokens * 8, cells * a.element_bytes


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int, chunks: int) -> int:
    """Micro-batch activations (of one model chunk) a pipeline stage holds at its peak.

    No pipeline: 1 (gradient accumulation runs micro-batches one after another). GPipe (Huang et al.
    2019): all m. 1F1B (Narayanan et al. 2021, sec. 2.2; Korthikanti sec. 4.2.3): min(p - stage, m).
    Interleaved: Megatron's warm-up count (p - stage - 1) * 2 + (v - 1) * p, plus the one in steady
    state, capped at m * v (megatron/core/pipeline_parallel/schedules.py).
    """
    if stages <= 1:
        return 1
    if schedule == "gpipe":
        return micro_batches * chunks
    if schedule == "interleaved" and chunks > 1:
        warmup = (stages - stage - 1) * 2 + (chunks - 1) * stages
        return min(warmup + 1, micro_batches * chunks)
    return min(stages - stage, micro_batches)
