"""The `megatron-te` stack: Megatron-Core with Transformer Engine, as large published runs use it."""

from __future__ import annotations

from dsforge.compiler.estimate.activations import MEGATRON_TE
from dsforge.compiler.estimate.stacks.profile import StackProfile

PROFILE = StackProfile(
    name="megatron-te",
    kernels=MEGATRON_TE,
    # megatron/core/pipeline_parallel/schedules.py deallocate_output_tensor: a stage's output is freed
    # (only its .grad_fn kept) once sent, so no pipeline buffer outlives the send
    pipeline_output_buffers=False,
    # megatron/core/transformer/moe: expert weights split over expert_tensor_parallel_size (= tp by default)
    experts_split_over_tp=True,
    # --use-distributed-optimizer (megatron/core/optimizer/distrib_optimizer.py): fp32 main params and Adam
    # moments sharded over DP; docs/source/api-guide/dist_optimizer.md: 6 + 12/d bytes per parameter with
    # bf16 params and fp32 main grads (Megatron's default for bf16: accumulate_allreduce_grads_in_fp32)
    distributed_optimizer=True,
    # the main-grad buffer's dtype (megatron/core/distributed/param_and_grad_buffer.py: grad_dtype = fp32 if
    # grad_reduce_in_fp32 else the param dtype); megatron/training/arguments.py sets
    # accumulate_allreduce_grads_in_fp32 for bf16 unless --grad-reduce-in-bf16 (the 16-bit buffer some
    # published runs use, which no job key selects yet), so gradients accumulate and reduce in fp32
    fp32_main_grads=True,
    # TE fused kernels: LayerNormLinear reads its input once and writes ln_out (2e per norm), fused
    # bias-dropout-add reads two and writes one h-wide tensor (3e, twice), fused RoPE (2e): ~12e per h
    # element; fused SwiGLU reads 2f and writes f (3e per f element)
    h_bytes=12,
    h_fp32_bytes=0,
    f_bytes=3,
    ce_bytes=12,  # fused vocab-parallel cross-entropy: logits read once forward, gradient written once
    # TE layers launch ~20 kernels forward and ~40 backward per layer (one per fused op, GEMM and collective)
    ops_forward=20,
    ops_backward=40,
    optimizer="megatron",
    sources=("activations: Korthikanti et al. 2022 Table 2 with flash attention (TE DotProductAttention)",
             "megatron/training/theoretical_memory_usage.py: (18 + 4 ffn/h) s b h per layer (selective, SP)",
             "pipeline: schedules.py deallocate_output_tensor",
             "optimizer: docs/source/api-guide/dist_optimizer.md (6 + 12/d bytes per parameter)",
             ("gradients: fp32 main-grad buffer, reduced in fp32 (training/arguments.py, bf16 default; "
              "core/distributed/param_and_grad_buffer.py grad_dtype)")),
)
