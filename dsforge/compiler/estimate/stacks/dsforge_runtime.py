"""The `dsforge` stack: what `dsforge run` and the trainer plugins execute (HF modules under DeepSpeed)."""

from __future__ import annotations

from dsforge.compiler.estimate.activations import HF_SDPA
from dsforge.compiler.estimate.stacks.profile import StackProfile

PROFILE = StackProfile(
    name="dsforge",
    kernels=HF_SDPA,
    pipeline_output_buffers=True,
    blocking_p2p=True,  # DeepSpeed's PipelineEngine (profile.py)
    experts_split_over_tp=False,
    distributed_optimizer=False,
    fp32_main_grads=False,
    # HF eager ops: two RMSNorms that upcast to fp32 (to fp32, square, mean, rsqrt-multiply, cast back,
    # weight: ~(4e + 28) bytes per element each), two residual adds (3e), RoPE on Q and K (~6e), the SDPA
    # output transpose (2e): ~22e + 56 per h element; SwiGLU's SiLU and product read 3 and write 2 f-wide
    # tensors (5e per f element; GELU's tanh approximation in plain ops ~16e, taken as the same order)
    h_bytes=22,
    h_fp32_bytes=56,
    f_bytes=5,
    ce_bytes=24,  # fp32 upcast, log-softmax and its gradient over every cell (transformers ForCausalLMLoss)
    # aten operations per layer, counted with a TorchDispatchMode over dsforge's HF tiny-llama (forward 73,
    # backward 138 per layer; tiny-gpt2 37 and 72): `benchmarks/predict_vs_measure.py --count-ops`
    ops_forward=73,
    ops_backward=138,
    sources=(("activations: tests/compiler/estimate/test_memory_measured.py "
              "(saved tensors of dsforge's HF models)"),
             "pipeline outputs: DeepSpeed PipelineEngine pipe_buffers['outputs']",
             "experts whole per TP rank: dsforge/runtime (DeepSpeed MoE has no expert tensor parallelism)",
             "optimizer: DeepSpeed ZeRO as configured (zero_config.py)",
             "operations per layer: counted on the HF tiny-llama (73 forward, 138 backward aten ops)"),
)
