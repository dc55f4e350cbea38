"""Which of dsforge's lean runtime kernels a job's model runs, and why one cannot (torch-free).

`training.kernels` names four kernels of dsforge's runtime (dsforge/runtime/kernels), each `auto` (on where
it is exact for the model's family), `true` (required: a family it cannot serve exactly is refused, DSF050)
or `false` (the plain HF modules, for debugging and exact comparison with HF):

* ``fused_loss``: the LM head and cross entropy fused and chunked over tokens, vocabulary-parallel under TP;
  no full-vocabulary fp32 logits are kept. Not for soft-capped final logits (Gemma2/3) nor pp > 1 (the
  pipeline's last stage forms whole logits for DeepSpeed's loss function).
* ``swiglu``: silu(gate) * up saving gate and up only (dense MLPs and shared experts of SwiGLU families;
  routed experts keep plain ops). Gemma's gate is GELU-tanh (GeGLU), not SiLU.
* ``gelu``: GPT-2's gelu_new saving its input only (GPT-NeoX's exact GELU already does).
* ``norm``: HF's RMSNorm saving its input and an fp32 rstd (LayerNorm families already do, natively).
  Gemma's RMSNorm scales by (1 + weight) in fp32, which the lean Function does not express.

The runtime installs what `lean_kernels` returns; the estimate prices the same set
(`estimate/lean.py`), so both follow one table.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsforge.compiler.model.resolved import ResolvedModel

KERNELS = ("fused_loss", "swiglu", "gelu", "norm")

#: At most this many logit cells (tokens x vocab/tp) exist at once in the fused loss, forward or backward:
#: 4 Mi cells, 16 MiB in fp32; a chunk holds at least one token.
LOSS_CHUNK_CELLS = 1 << 22

_RMS_LLAMA = frozenset({"llama", "mixtral", "qwen3", "olmo2", "phi3", "qwen2_moe", "qwen3_moe",
                        "deepseek_v3"})
_LAYERNORM = frozenset({"gpt2", "gpt_neox"})
_SWIGLU = frozenset({"llama", "mixtral", "qwen3", "olmo2", "phi3", "qwen2_moe", "qwen3_moe", "deepseek_v3"})
_GEMMA = frozenset({"gemma2", "gemma3"})


def loss_chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk of the fused loss for ``vocab_local`` vocabulary rows on this rank."""
    return max(1, LOSS_CHUNK_CELLS // max(1, vocab_local))


def family_of(model: ResolvedModel) -> str | None:
    """The family whose modules the runtime will see: the arch, or for `auto` without a pretrained
    directory the HF model dsforge builds from the fields; None when only run time can tell."""
    if model.arch == "custom" or (model.arch == "auto" and model.pretrained):
        return None
    if model.arch != "auto":
        return model.arch
    if model.moe is not None:
        return "mixtral"
    return "gpt2" if model.activation == "gelu" and model.position == "learned" else "llama"


def kernel_problem(kernel: str, model: ResolvedModel, pp: int) -> str | None:
    """Why ``kernel`` cannot run exactly for this model and layout (None: it can)."""
    fam = family_of(model)
    if fam is None:
        what = "arch: custom" if model.arch == "custom" else "an HF directory read with arch: auto"
        return f"{what}: dsforge cannot tell before run time which modules it has"
    if kernel == "fused_loss":
        if fam in _GEMMA:
            return f"{fam} soft-caps its final logits (tanh), which the fused loss does not apply"
        if pp > 1:
            return f"pp={pp}: the pipeline's last stage forms whole logits for DeepSpeed's loss function"
        return None
    if kernel == "swiglu":
        if fam in _SWIGLU:
            return None
        if fam in _GEMMA:
            return f"{fam}'s gated MLP uses a GELU-tanh gate (GeGLU), not SiLU"
        return f"{fam} has no SwiGLU MLP"
    if kernel == "gelu":
        return None if fam in _LAYERNORM else f"{fam} has no GELU MLP"
    if kernel == "norm":
        if fam in _RMS_LLAMA or fam in _LAYERNORM:
            return None
        return f"{fam}'s RMSNorm scales by (1 + weight) in fp32, which the lean RMSNorm does not express"
    raise KeyError(kernel)


def lean_kernels(model: ResolvedModel, requested: Mapping[str, bool | str], pp: int) -> frozenset[str]:
    """The kernels the runtime runs: each asked for (true) or left `auto` and exact for this model."""
    return frozenset(k for k in KERNELS
                     if requested.get(k, "auto") is not False and kernel_problem(k, model, pp) is None)


def refused_kernels(model: ResolvedModel, requested: Mapping[str, bool | str], pp: int) -> dict[str, str]:
    """Kernels the job requires (true) that cannot run exactly, with the reason."""
    out: dict[str, str] = {}
    for k in KERNELS:
        if requested.get(k, "auto") is True:
            why = kernel_problem(k, model, pp)
            if why:
                out[k] = why
    return out
