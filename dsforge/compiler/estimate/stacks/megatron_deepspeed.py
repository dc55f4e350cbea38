"""The `megatron-deepspeed` stack: DeepSpeed's Megatron fork (deepspeedai/Megatron-DeepSpeed), which trained
BLOOM and MT-NLG: Megatron's legacy fused kernels on DeepSpeed's engine, ZeRO 1-3 and PipelineEngine.

Sources at deepspeedai/Megatron-DeepSpeed 4efb479:
* kernels: megatron/arguments.py:903-906 (masked_softmax_fusion, bias_gelu_fusion on by default), :927-933
  (flash attention only with --use-flash-attn*, off by default): the unfused attention of Korthikanti et al.
  2022 (5 a s^2 b score bytes per layer) with fused softmax and dropout masks, which `activations.MEGATRON`
  states; the vocab-parallel cross-entropy upcasts the logits to fp32 (megatron/core/tensor_parallel/
  cross_entropy.py);
* pipeline: megatron/model/gpt_model.py:459-463, GPTModelPipe hands DeepSpeed's PipelineModule its layer
  specs with partition_method='type:transformer' (each transformer layer weighs 1, the embedding, norm
  and head 0: deepspeed/runtime/pipe/module.py _partition_layers), and DeepSpeed's PipelineEngine keeps
  each in-flight micro-batch's output (pipe_buffers), as under dsforge's runtime;
* model states: DeepSpeed's ZeRO and BF16_Optimizer as configured (model_states.py), experts whole per
  TP rank (deepspeed/moe: no expert tensor parallelism).
"""

from __future__ import annotations

from dsforge.compiler.estimate.activations import MEGATRON
from dsforge.compiler.estimate.stacks.profile import StackProfile

PROFILE = StackProfile(
    name="megatron-deepspeed",
    kernels=MEGATRON,
    pipeline_output_buffers=True,
    blocking_p2p=True,  # DeepSpeed's PipelineEngine (profile.py)
    experts_split_over_tp=False,
    distributed_optimizer=False,
    fp32_main_grads=False,
    # apex FusedLayerNorm reads its input and writes the output (2e, twice), the fused bias-dropout-add reads
    # two and writes one h-wide tensor (3e, twice), the fused scaled-masked softmax's output transposes (2e):
    # ~12e per h element; fused bias-GELU reads f and writes f (2e) plus the bias (taken as 3e per f element)
    h_bytes=12,
    h_fp32_bytes=0,
    f_bytes=3,
    ce_bytes=24,  # the vocab-parallel cross-entropy's fp32 upcast, softmax and gradient over every cell
    ops_forward=30,  # the fused kernels, GEMMs, the softmax and dropout per layer; backward about twice
    ops_backward=60,
    sources=(("kernels: Megatron-DeepSpeed megatron/arguments.py:903-933 (fused softmax and bias-GELU on, "
              "flash attention off by default); Korthikanti et "
              "al. 2022 Table 2 (34 sbh + 5 a s^2 b per layer)"),
             ("pipeline: megatron/model/gpt_model.py:463 partition_method='type:transformer'; DeepSpeed "
              "PipelineEngine pipe_buffers['outputs']"),
             "optimizer: DeepSpeed ZeRO as configured (zero_config.py)"),
)
