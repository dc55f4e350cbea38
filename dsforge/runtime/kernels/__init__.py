"""dsforge's lean runtime kernels: autograd Functions that keep only what backward needs (see
docs/runtime.md).

`fused_ce` (chunked LM head + cross entropy, vocabulary-parallel), `swiglu`, `gelu` (GPT-2's gelu_new),
`norms` (HF's RMSNorm); `install` puts them into a model; `loss` is the runtime's fused token loss.
"""
