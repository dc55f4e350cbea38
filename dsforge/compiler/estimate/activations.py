"""Activation memory: the tensors a transformer layer saves for backward, per micro-batch.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4:
a GPT layer saves s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations (eq. 1); with tensor
parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t)) (eq. 2); with sequence parallelism all of it is divided
by t (eq. 3); selective recomputation drops the 5*a*s/h attention-score term (eq. 4); full
recomputation keeps only the layer input, 2*s*b*h (/t when sharded). This module derives the same
terms tensor by tensor, so that it also covers GQA (K/V narrower than Q), SwiGLU, any ffn width, fp32
activations, context parallelism (s/cp local tokens attending to all s keys), MoE layers, and the
kernels an implementation really uses, described by a `Kernels` profile:

* `MEGATRON`, the paper's setting: unfused attention (softmax output and dropout on the scores),
  dropout 0.1 with fused 1-byte masks, fused masked softmax, fused GELU (input and output saved) and
  fused SwiGLU (Megatron's `SwiGLUFunction` saves its 2f input; the down projection saves its f input);
* `HF_SDPA`, what `dsforge.runtime` runs (HF transformers modules with `attn_implementation="sdpa"`
  and dropout 0, `dsforge/runtime/models.py`): SDPA picks a flash kernel on GPUs and, in torch 2.x,
  on the CPU too, saving Q, K, V (GQA not expanded), the output and an fp32 log-sum-exp per head and
  token; HF's RMSNorm upcasts to fp32 and saves that copy, an fp32 rstd and the normalised tensor in
  the compute dtype; GPT-2's `gelu_new` (tanh approximation in plain ops) saves five f-wide tensors,
  Llama's SwiGLU four (gate, up, SiLU output, product); the loss upcasts the logits to fp32;
* `EAGER`, explicit PyTorch ops on the CPU (matmul-softmax attention, `F.dropout` multiplying by a
  noise tensor of the activation dtype, `masked_fill` keeping the boolean causal mask, exact GELU).

Measured with `torch.autograd.graph.saved_tensors_hooks` (tests/compiler/estimate/test_memory_measured.py),
the count matches the saved tensors of the `EAGER` test GPT and of dsforge's HF models exactly in fp32.
LayerNorm saves fp32 mean and rstd per token; RoPE saves only cos/sin shared by all layers (not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.model.lean_kernels import loss_chunk_tokens
from dsforge.compiler.model.params import has_bias, kv_heads_per_rank, shared_gate
from dsforge.compiler.model.resolved import ResolvedModel

FP32 = 4
MASK = 1  # a fused dropout kernel keeps one byte per element


@dataclass(frozen=True)
class Kernels:
    """Which saved tensors an implementation's kernels produce (see the module doc)."""

    fused_attention: bool  # flash/SDPA: Q, K, V, output and fp32 log-sum-exp instead of score matrices
    dropout: bool  # dropout after attention scores, attention output and MLP
    byte_masks: bool  # dropout keeps 1-byte masks (fused kernel); else a noise tensor of the activation dtype
    causal_mask_saved: bool  # unfused masking keeps a boolean s x s mask per layer
    hf_rmsnorm: bool  # RMSNorm saves an fp32 copy of its input and its normalised output (HF transformers)
    gelu_tensors: int  # f-wide tensors a GELU MLP saves (2: fused or exact GELU; 5: HF gelu_new)
    swiglu_tensors: int  # f-wide tensors a SwiGLU MLP saves (3: Megatron's fused SwiGLU; 4: plain ops)
    fp32_logits: bool  # the loss upcasts 16-bit logits to an fp32 copy
    # Under sequence parallelism an MoE block's router reads (and saves) the whole gathered sequence:
    # dsforge's runtime gathers it at the block boundary and runs the replicated router on it (Megatron routes
    # the shard).
    moe_input_gathered: bool = False
    # dsforge's fused, chunked LM head + loss (dsforge/runtime/kernels/fused_ce.py): the fp32 row maximum and
    # sum of exponentials and the int64 target per token kept, one chunk of logits alive at a time
    chunked_loss: bool = False
    # f-wide tensors a routed SwiGLU expert saves, when they differ from the dense MLP's (0: swiglu_tensors)
    expert_swiglu_tensors: int = 0


MEGATRON = Kernels(fused_attention=False, dropout=True, byte_masks=True, causal_mask_saved=False,
                   hf_rmsnorm=False, gelu_tensors=2, swiglu_tensors=3, fp32_logits=True)
HF_SDPA = Kernels(fused_attention=True, dropout=False, byte_masks=True, causal_mask_saved=False,
                  hf_rmsnorm=True, gelu_tensors=5, swiglu_tensors=4, fp32_logits=True,
                  moe_input_gathered=True)
#: Megatron-Core with Transformer Engine (the `megatron-te` stack): TE's DotProductAttention runs a flash
#: kernel (Q, K, V, output and the fp32 log-sum-exp saved, attention dropout inside the kernel), hidden
#: dropout 0.1 with 1-byte masks (Megatron's default), TE LayerNormLinear saves input and ln_out, fused
#: bias-GELU saves fc1's output and fc2's input (2), fused SwiGLU its 2f input and fc2's f input (3), and the
#: fused vocab-parallel cross-entropy computes in fp32 without a materialised fp32 copy of the logits.
MEGATRON_TE = Kernels(fused_attention=True, dropout=True, byte_masks=True, causal_mask_saved=False,
                      hf_rmsnorm=False, gelu_tensors=2, swiglu_tensors=3, fp32_logits=False)
EAGER = Kernels(fused_attention=False, dropout=True, byte_masks=False, causal_mask_saved=True,
                hf_rmsnorm=False, gelu_tensors=2, swiglu_tensors=4, fp32_logits=True)


@dataclass(frozen=True)
class ActivationShape:
    """What sizes one rank's activations: micro-batch, sequence, degrees, precision and kernels."""

    micro_batch: int
    seq_len: int
    tp: int
    cp: int
    sequence_parallel: bool
    element_bytes: int  # 2 for bf16/fp16 activations, 4 for fp32
    kernels: Kernels = HF_SDPA
    partition_checkpoints: bool = False  # full recompute keeps 1/tp of each layer input
                                         # (partition_activations)
    experts_split: bool = False  # expert matrices split over tp (Megatron-Core), else whole on every TP rank

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch held by this rank (the sequence is split over cp)."""
        return self.micro_batch * self.seq_len / self.cp

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a saved dropout mask."""
        return MASK if self.kernels.byte_masks else self.element_bytes

    @property
    def sp_div(self) -> int:
        """Divisor of the norm/dropout region: tp with sequence parallelism, else 1 (replicated)."""
        return self.tp if self.sequence_parallel else 1


def norm_bytes(model: ResolvedModel, a: ActivationShape) -> float:
    """Bytes per token one norm saves: LayerNorm its input and fp32 mean/rstd; RMSNorm its input and an
    fp32 rstd, or with HF's implementation an fp32 copy of the input, the rstd and the normalised output."""
    e, h = a.element_bytes, model.hidden
    if has_bias(model):
        return h * e + 2 * FP32
    if a.kernels.hf_rmsnorm:
        return h * FP32 + FP32 + h * e
    return h * e + FP32


def attention_terms(model: ResolvedModel, a: ActivationShape) -> dict[str, float]:
    """Bytes one layer's attention block saves for backward (one micro-batch), by tensor group."""
    h, t, e, n, k = model.hidden, a.tp, a.element_bytes, a.tokens, a.kernels
    kv_dim = kv_heads_per_rank(model, t) * model.head_dim
    q_dim = model.heads * model.head_dim  # heads x head_dim need not equal hidden (Qwen3, Gemma)
    heads = model.heads / t
    terms = {
        "norm": n * norm_bytes(model, a) / a.sp_div,
        "qkv_input": n * h * e / a.sp_div,
        "q_k_v": n * (q_dim / t + 2 * kv_dim) * e,
        "attn_output": n * q_dim / t * e,  # input of the output projection (also the fused kernel's output)
    }
    if k.fused_attention:
        # Also what dsforge's ring attention keeps under cp > 1 (dsforge/runtime/attention/ring.py): q, k, v
        # and the output of the local tokens and this fp32 log-sum-exp; its backward recomputes each
        # block's scores, so no s x s/cp term (measured at S=1024, cp 2:
        # tests/compiler/estimate/test_memory_measured.py).
        terms["softmax_lse"] = n * heads * FP32
    else:
        scores = n * heads * a.seq_len  # each local query row against all s keys
        terms["scores"] = scores * e  # softmax output
        if k.dropout:
            terms["scores"] += scores * (a.mask_bytes + e)  # dropout mask and dropout output
        if k.causal_mask_saved:
            terms["causal_mask"] = a.seq_len / a.cp * a.seq_len * MASK
    if k.dropout:
        terms["dropout_masks"] = n * h * a.mask_bytes / a.sp_div
    return terms


def _mlp_inner(model: ResolvedModel, a: ActivationShape, ffn: int, tp: int | None = None,
               routed: bool = False) -> float:
    """Bytes per token an MLP saves inside its tp-split region (the f-wide tensors; ``routed``: an
    expert's)."""
    per = a.kernels.swiglu_tensors if model.activation == "swiglu" else a.kernels.gelu_tensors
    if routed and model.activation == "swiglu" and a.kernels.expert_swiglu_tensors:
        per = a.kernels.expert_swiglu_tensors
    return per * ffn / (a.tp if tp is None else tp) * a.element_bytes


def shared_expert_bytes(model: ResolvedModel, a: ActivationShape) -> float:
    """Bytes per token the shared experts of an MoE block save (Qwen2-MoE, DeepSeek): a dense MLP every
    token passes through, split over tp by its column/row rows, on the block's input (counted once, as
    the MLP input). Qwen2-MoE's sigmoid gate multiplies its output: the product keeps the h-wide output
    and the one-wide gate value."""
    m = model.moe
    if m is None or not m.shared_experts:
        return 0.0
    inner = _mlp_inner(model, a, m.shared_experts * m.shared_ffn_hidden)
    return inner + ((model.hidden + 1) * a.element_bytes if shared_gate(model) else 0.0)


def mlp_terms(model: ResolvedModel, a: ActivationShape, moe: bool) -> dict[str, float]:
    """Bytes one layer's MLP block (dense or MoE) saves for backward (one micro-batch)."""
    h, e, n = model.hidden, a.element_bytes, a.tokens
    gathered = moe and model.moe is not None and a.kernels.moe_input_gathered
    terms = {"norm": n * norm_bytes(model, a) / a.sp_div,
             "mlp_input": n * h * e / (1 if gathered else a.sp_div)}
    if moe and model.moe is not None:
        m = model.moe
        routed = n * m.top_k * m.capacity_factor  # token copies processed by the experts on this rank
        terms["router"] = n * m.experts * e + n * m.top_k * (e + 8)  # probabilities, top-k weights, indices
        # Experts run whole on every TP rank, on all the micro-batch's tokens (the runtime gathers the
        # sequence into the MoE block under SP): neither the ffn width nor the tokens split by tp.
        # (A stack with expert tensor parallelism splits the ffn width over tp, still on all routed tokens.)
        inner = _mlp_inner(model, a, m.ffn_hidden, tp=a.tp if a.experts_split else 1, routed=True)
        terms["experts"] = routed * (2 * h * e + inner)  # input, inner, output
        if m.shared_experts:
            terms["shared_experts"] = n * shared_expert_bytes(model, a)
    else:
        terms["mlp_inner"] = n * _mlp_inner(model, a, model.ffn_hidden)
    if a.kernels.dropout:
        terms["dropout_masks"] = n * h * a.mask_bytes / a.sp_div
    return terms


def layer_terms(model: ResolvedModel, a: ActivationShape, moe: bool) -> dict[str, float]:
    """All bytes one layer saves for backward with no recomputation, by tensor group."""
    attn = {"attn." + k: v for k, v in attention_terms(model, a).items()}
    return {**attn, **{"mlp." + k: v for k, v in mlp_terms(model, a, moe).items()}}


def layer_bytes(model: ResolvedModel, a: ActivationShape, moe: bool, recompute: str) -> float:
    """Bytes one layer keeps for backward under a recompute policy (Korthikanti et al. 2022, sec. 4-5).

    none: every saved tensor; selective: all but the attention scores (eq. 4); full: only the layer
    input, s*b*h, divided by t when it is sharded: with sequence parallelism, or when DeepSpeed's
    `activation_checkpointing.partition_activations` splits it over the tensor-parallel group.
    """
    if recompute == "full":
        div = a.tp if a.partition_checkpoints else a.sp_div
        return a.tokens * model.hidden * a.element_bytes / div
    terms = layer_terms(model, a, moe)
    if recompute == "selective":
        terms.pop("attn.scores", None)
        terms.pop("attn.causal_mask", None)
    return sum(terms.values())


def recompute_working_set(model: ResolvedModel, a: ActivationShape, moe: bool, recompute: str) -> float:
    """Bytes rematerialised for one layer during backward: the dropped tensors of one layer."""
    if recompute == "none":
        return 0.0
    full = sum(layer_terms(model, a, moe).values())
    return full - layer_bytes(model, a, moe, recompute)


def embedding_bytes(model: ResolvedModel, a: ActivationShape) -> float:
    """Bytes the input embedding saves: int64 token (and position) ids, and a dropout mask if any."""
    saved = a.tokens * 8
    if model.position == "learned":
        saved += a.seq_len / a.cp * 8
    if a.kernels.dropout:
        saved += a.tokens * model.hidden * a.mask_bytes / a.sp_div
    return saved


def head_bytes(model: ResolvedModel, a: ActivationShape) -> float:
    """Bytes the final norm and LM head save: the norm's tensors and the head's input."""
    return a.tokens * norm_bytes(model, a) / a.sp_div + a.tokens * model.hidden * a.element_bytes


def logits_bytes(model: ResolvedModel, a: ActivationShape, vocab: int) -> tuple[float, float]:
    """(saved, transient) bytes of the loss: fp32 log-probabilities and int64 targets kept for
    backward; the logits in the compute dtype (and their fp32 copy when the loss upcasts 16-bit
    logits) alive while the loss is formed. The vocabulary is split over tp (vocabulary-parallel
    cross-entropy)."""
    cells = a.tokens * vocab / a.tp
    if a.kernels.chunked_loss:
        # fused_ce.py: the head's input (head_bytes) and per token the fp32 row maximum and sum of
        # exponentials and the int64 target; alive at once: one chunk's logits in the compute dtype and their
        # fp32 copy (in fp32 the same tensor), which the loss then works on in place (its exponentials, or in
        # backward its gradient)
        chunk = min(a.tokens, loss_chunk_tokens(max(1, int(vocab // a.tp)))) * vocab / a.tp
        copy = FP32 if a.element_bytes != FP32 else 0
        return a.tokens * (2 * FP32 + 8), chunk * (a.element_bytes + copy)
    upcast = FP32 if a.kernels.fp32_logits and a.element_bytes != FP32 else 0
    return cells * FP32 + a.tokens * 8, cells * (a.element_bytes + upcast)


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
