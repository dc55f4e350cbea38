"""Compute time of one pass from physics: GEMMs at a measured efficiency, memory-bound work from its bytes.

Per rank and micro-batch, each matrix multiply of a layer (Q/K/V, output, MLP or experts, the logits)
takes max(2mnk / (peak x gemm_efficiency), bytes / (HBM x memory_efficiency)): a roofline (Williams et al.
2009), so small GEMMs fall to the memory bound and the share of peak a layer reaches rises with its width.
The attention core runs at the GEMM rate over its counted FLOPs where it is a flash kernel (GEMM-bound);
unfused attention (`Kernels.fused_attention` false: Megatron's baddbmm, fused scale-mask-softmax, dropout
and bmm over materialised s x s scores) prices each of those kernels by its roofline over the score
matrix, which is memory-bound at any head_dim below the accelerator's ridge (`_unfused_core`). Norms,
activations, residual adds, RoPE and the loss move the bytes the stack profile states (`stacks/`), at
HBM x memory_efficiency; every framework operation costs op_overhead_us (dispatch and launch, the term
that dominates tiny models on a CPU). A backward pass runs two GEMMs per forward GEMM and moves twice the
bytes; recomputation adds the forward (full) or the attention core (selective) again.

Rates come from the accelerator: gemm_efficiency, memory_efficiency and op_overhead_us, measured by
`dsforge calibrate` or stated by a preset with its source. ``achievable_fraction``, when set, overrides
the model: every FLOP at that fraction of peak and nothing else. With neither, large GEMMs get
`DEFAULT_GEMM_EFFICIENCY` and the step says so (`Rates.source`). CPU processes beyond the host's cores
time-share them: the ranks of a node on ``hardware.host_cores`` cores run ranks/cores slower.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.compiler.estimate import flops
from dsforge.compiler.estimate.lean import requested_kernels
from dsforge.compiler.estimate.memo import bounded
from dsforge.compiler.estimate.shares import kv_heads_per_rank
from dsforge.compiler.estimate.stacks import StackProfile, profile_of
from dsforge.compiler.model.lean_kernels import lean_kernels
from dsforge.compiler.model.params import is_moe_layer, padded_vocab
from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.plan.plan import Priced

#: Large-GEMM efficiency for an accelerator that states none: cuBLAS bf16 GEMMs of 8k-16k reach 0.7-0.8 of
#: dense peak on A100 and H100 (NVIDIA's Deep Learning Performance guide, "Matrix multiplication" section).
DEFAULT_GEMM_EFFICIENCY = 0.7
#: Share of HBM bandwidth that elementwise kernels reach when the accelerator states none (STREAM-like
#: copies reach ~0.8-0.9 of HBM's data-sheet rate on A100/H100).
DEFAULT_MEMORY_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Rates:
    """What one rank's compute runs at: peak, GEMM and memory efficiencies, per-op cost, time-sharing."""

    peak_flops: float
    gemm_efficiency: float
    memory_Bps: float
    op_overhead_s: float
    slowdown: float  # ranks per compute unit (>= 1): CPU processes sharing cores
    override: float | None  # achievable_fraction: every FLOP at this fraction of peak, nothing else
    source: str
    #: the linear layers' GEMM peak where it differs from ``peak_flops`` (FP8: TE's FP8 GEMMs; attention's
    #: core, the router and the LM head stay 16-bit, as Megatron-Core runs them)
    linear_peak_flops: float | None = None

    @property
    def fraction(self) -> float:
        """The fraction of peak the compute-bound work reaches (the override, or the GEMM efficiency)."""
        return self.override if self.override is not None else self.gemm_efficiency


def rates(plan: Priced, peak_flops: float) -> Rates:
    """The compute rates of a plan's accelerator (see the module doc for the precedence); FP8 jobs run their
    linear layers at the FP8 peak."""
    base = _rates(plan, peak_flops)
    if plan.spec.training.precision != "fp8" or base.override is not None:
        return base
    fp8 = flops.fp8_peak_flops(plan.spec.hardware.accelerator)
    return replace(base, linear_peak_flops=fp8 or None,
                   source=base.source + "; linear-layer GEMMs at the FP8 peak (Transformer Engine)")


def _rates(plan: Priced, peak_flops: float) -> Rates:
    hw = plan.spec.hardware
    acc = hw.accelerator
    ranks = min(plan.world_size, hw.gpus_per_node)
    slowdown = max(1.0, ranks / hw.host_cores) if on_cpu(plan) and hw.host_cores else 1.0
    mem = acc.hbm_gbs * 1e9 * (acc.memory_efficiency or DEFAULT_MEMORY_EFFICIENCY)
    overhead = (acc.op_overhead_us or 0.0) * 1e-6
    if acc.achievable_fraction is not None:
        return Rates(peak_flops, acc.achievable_fraction, mem, 0.0, slowdown, acc.achievable_fraction,
                     "hardware.accelerator.achievable_fraction (override: every FLOP at this share of peak)")
    if acc.gemm_efficiency is not None:
        source = (f"GEMMs at gemm_efficiency {acc.gemm_efficiency:.2f} of peak, memory-bound work at "
                  f"{mem / 1e9:.0f} GB/s, {overhead * 1e6:.1f} us per operation (hardware.accelerator)")
        return Rates(peak_flops, acc.gemm_efficiency, mem, overhead, slowdown, None, source)
    source = (f"dsforge default: {acc.name} states no gemm_efficiency, so large GEMMs are taken at "
              f"{DEFAULT_GEMM_EFFICIENCY:.2f} of peak; measure it with `dsforge calibrate` or set "
              f"hardware.accelerator.gemm_efficiency")
    return Rates(peak_flops, DEFAULT_GEMM_EFFICIENCY, mem, overhead, slowdown, None, source)


@dataclass(frozen=True)
class ChunkTime:
    """Seconds of one micro-batch's forward and backward through one chunk on one rank."""

    forward_s: float
    backward_s: float  # with recomputation
    attention_s: float  # the attention core's part of the forward (what ring CP overlaps with)


def _gemm(m: float, k: float, n: float, e: int, r: Rates) -> float:
    """Roofline time of one (m x k) @ (k x n) GEMM in the compute dtype."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    return max(2.0 * m * k * n / (r.peak_flops * r.gemm_efficiency),
               e * (m * k + k * n + m * n) / r.memory_Bps)


def _linear(m: float, k: float, n: float, e: int, r: Rates) -> float:
    """A linear layer's GEMM: at the FP8 peak under FP8 (its 1-byte operands), else as `_gemm`."""
    if r.linear_peak_flops is None or m <= 0 or k <= 0 or n <= 0:
        return _gemm(m, k, n, e, r)
    return max(2.0 * m * k * n / (r.linear_peak_flops * r.gemm_efficiency),
               (m * k + k * n + e * m * n) / r.memory_Bps)


def _unfused_core(scores: float, head_dim: int, e: int, dropout: bool, r: Rates) -> tuple[float, float]:
    """(forward, backward) seconds of unfused attention over ``scores`` score elements (tokens x keys x
    heads on this rank): each kernel at its own roofline.

    Forward (Megatron-LM d98e8a6 megatron/core/transformer/dot_product_attention.py:194-239, as the legacy
    CoreAttention and Megatron-DeepSpeed run it): Q K^T by baddbmm (2·head_dim
    FLOPs per score, the score written), the fused scale-mask-softmax (read and write), dropout on the
    probabilities (read, write, a 1-byte mask), probabilities @ V (2·head_dim FLOPs, the probabilities
    read). Backward: dP = dO V^T and dV = P^T dO, dropout's backward (read, mask, write), softmax's (read
    the output and the gradient, write), dQ and dK (two GEMMs reading dS)."""
    flop = 2.0 * head_dim / (r.peak_flops * r.gemm_efficiency)
    byte = 1.0 / r.memory_Bps
    gemm = max(flop, e * byte)  # one score-sized GEMM operand per head_dim-deep product
    drop = (2 * e + 1) * byte if dropout else 0.0
    forward = 2 * gemm + 2 * e * byte + drop
    backward = 4 * gemm + 3 * e * byte + drop
    return scores * forward, scores * backward


def _layer(model: ResolvedModel, moe: bool, tokens: float, tp: int, ep: int, sp_div: int, e: int,
           prof: StackProfile, r: Rates) -> tuple[float, float, float, float]:
    """(GEMM seconds, attention-core forward and backward seconds, memory-bound seconds) of one layer's
    forward on one rank (the backward's GEMMs and memory-bound work are twice the forward's)."""
    h, s = model.hidden, model.seq_len
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    q = model.heads * model.head_dim  # heads x head_dim need not equal hidden (Qwen3, Gemma)
    mats = 3 if model.activation == "swiglu" else 2
    gemm = _linear(tokens, h, q / tp + 2 * kv, e, r) + _linear(tokens, q / tp, h, e, r)
    if prof.kernels.fused_attention:
        core_flops = 4.0 * tokens * s * q / tp
        attention = max(core_flops / (r.peak_flops * r.gemm_efficiency),
                        e * tokens * (2 * q / tp + 2 * kv) / r.memory_Bps)
        attention_bwd = 2 * attention
    else:
        attention, attention_bwd = _unfused_core(tokens * s * model.heads / tp, model.head_dim, e,
                                                 prof.kernels.dropout, r)
    elementwise = tokens * (prof.h_bytes * e + prof.h_fp32_bytes) * h / sp_div
    if moe and model.moe is not None:
        m = model.moe
        xtp = tp if prof.experts_split_over_tp else 1
        routed = tokens * m.top_k * m.capacity_factor
        local = max(1, m.experts // max(1, ep))
        per_expert = routed / local
        gemm += _gemm(tokens, h, m.experts, e, r)
        gemm += local * (_linear(per_expert, h, (mats - 1) * m.ffn_hidden / xtp, e, r)
                         + _linear(per_expert, m.ffn_hidden / xtp, h, e, r))
        elementwise += routed * prof.f_bytes * e * m.ffn_hidden / xtp
    else:
        f = model.ffn_hidden
        gemm += _linear(tokens, h, (mats - 1) * f / tp, e, r) + _linear(tokens, f / tp, h, e, r)
        elementwise += tokens * prof.f_bytes * e * f / tp
    return gemm, attention, attention_bwd, elementwise / r.memory_Bps


def chunk_time(plan: Priced, first_layer: int, layers: int, first: bool, last: bool, r: Rates) -> ChunkTime:
    """Seconds of one micro-batch through layers [first_layer, first_layer + layers) on one rank."""
    d, model, t = plan.degrees, plan.model, plan.spec.training
    if r.override is not None:
        f = flops.chunk_flops(plan, first_layer, layers, first, last)
        speed = r.peak_flops * r.override
        return ChunkTime(f.forward / speed * r.slowdown, f.backward / speed * r.slowdown,
                         f.attention_forward / speed * r.slowdown)
    e = 4 if t.precision == "fp32" else 2
    tokens = t.micro_batch * model.seq_len / d.cp
    sp_div = d.tp if plan.spec.parallel.sequence_parallel and d.tp > 1 else 1
    fused = last and "fused_loss" in lean_kernels(model, requested_kernels(plan), d.pp) \
        if plan.spec.stack == "dsforge" else False
    return _chunk_time(model, d.tp, d.ep, sp_div, e, tokens, plan.spec.stack, t.recompute, r,
                       flops.moe_phase(model, first_layer), layers, last, fused, t.attention)


@bounded(maxsize=4096)
def _chunk_time(model: ResolvedModel, tp: int, ep: int, sp_div: int, e: int, tokens: float, stack: str,
                recompute: str, r: Rates, phase: int, layers: int, last: bool,
                fused_loss: bool = False, attention: str = "auto") -> ChunkTime:
    """`chunk_time` from what it reads: the layers from period ``phase`` (`flops.moe_phase`) are summed one by
    one, the order the per-chunk sum always had, so the seconds are the same floats (``fused_loss``: dsforge's
    fused loss recomputes the head's logits in backward, dsforge/runtime/kernels/fused_ce.py)."""
    prof = profile_of(stack, attention)
    fwd = bwd = attn = 0.0
    cache: dict[bool, tuple[float, float, float, float]] = {}
    for i in range(phase, phase + layers):
        moe = is_moe_layer(model, i)
        if moe not in cache:
            cache[moe] = _layer(model, moe, tokens, tp, ep, sp_div, e, prof, r)
        gemm, core, core_bwd, mem = cache[moe]
        layer_fwd = gemm + core + mem + prof.ops_forward * r.op_overhead_s
        fwd += layer_fwd
        attn += core
        bwd += 2 * (gemm + mem) + core_bwd + prof.ops_backward * r.op_overhead_s
        if recompute == "full":
            bwd += layer_fwd
        elif recompute == "selective":
            bwd += core
    if last:
        vocab = padded_vocab(model, tp) / tp
        head = _gemm(tokens, model.hidden, vocab, e, r)
        loss = tokens * vocab * prof.ce_bytes / r.memory_Bps
        fwd += head + loss / 2
        bwd += 2 * head + loss / 2 + (head if fused_loss else 0.0)
    return ChunkTime(fwd * r.slowdown, bwd * r.slowdown, attn * r.slowdown)
