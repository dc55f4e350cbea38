"""Putting the lean kernels into a (rewritten) HF model, and the fused loss of the runtime's causal LM.

`install_lean_kernels` swaps the forward of each module whose class it knows, leaving the module, its
parameters and every hook on it as they were (the rewrite's sequence regions and gradient hooks still
apply): HF's Llama-style RMSNorms run `norms.rms_norm`, SwiGLU MLPs and dsforge's routed experts
(`moe.GatedExpert`) `swiglu.swiglu`, GPT-2's `gelu_new`
`gelu.LeanGeluNew`. Which kernels run is decided before, by `dsforge.compiler.model.lean_kernels` (the
estimate reads the same table); a module class outside the known ones keeps its own forward.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from dsforge.runtime.kernels.gelu import LeanGeluNew
from dsforge.runtime.kernels.norms import rms_norm
from dsforge.runtime.kernels.swiglu import swiglu
from dsforge.runtime.moe import GatedExpert

#: HF RMSNorms computing weight * normed.to(dtype) (LlamaRMSNorm's forward) and (weight * normed).to(dtype).
RMS_CAST_FIRST = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                            "MixtralRMSNorm", "Phi3RMSNorm", "DeepseekV3RMSNorm", "Qwen2MoeRMSNorm",
                            "Qwen3MoeRMSNorm"})
RMS_CAST_LAST = frozenset({"Olmo2RMSNorm"})
#: HF MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x)).
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Olmo2MLP", "DeepseekV3MLP",
                         "Qwen2MoeMLP", "Qwen3MoeMLP"})
#: Phi3MLP: gate_up_proj, chunk(2), up * activation_fn(gate), down_proj.
FUSED_GATE_UP_MLPS = frozenset({"Phi3MLP"})
_SILU = frozenset({"SiLU", "SiLUActivation"})


def _rms_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, self._dsforge_cast_first)


def _swiglu_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _gate_up_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(swiglu(gate, up))


def _expert_forward(self: nn.Module, x: Tensor) -> Tensor:
    gate, up = self.gate_up(x).chunk(2, dim=-1)
    return self.down(swiglu(gate, up))


def _silu(module: Any) -> bool:
    return type(module).__name__ in _SILU


def install_lean_kernels(model: nn.Module, kernels: Iterable[str]) -> dict[str, int]:
    """Swap in the lean forward of every known module for each of ``kernels``; the count per kernel."""
    on = frozenset(kernels)
    counts = {"norm": 0, "swiglu": 0, "gelu": 0}
    for module in model.modules():
        name = type(module).__name__
        if "norm" in on and (name in RMS_CAST_FIRST or name in RMS_CAST_LAST):
            module._dsforge_cast_first = name in RMS_CAST_FIRST
            module.forward = types.MethodType(_rms_forward, module)
            counts["norm"] += 1
        elif "swiglu" in on and name in SWIGLU_MLPS and _silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_swiglu_forward, module)
            counts["swiglu"] += 1
        elif "swiglu" in on and name in FUSED_GATE_UP_MLPS and _silu(getattr(module, "activation_fn", None)):
            module.forward = types.MethodType(_gate_up_forward, module)
            counts["swiglu"] += 1
        elif "swiglu" in on and isinstance(module, GatedExpert):  # dsforge's routed experts (moe.py)
            module.forward = types.MethodType(_expert_forward, module)
            counts["swiglu"] += 1
        elif "gelu" in on and name == "GPT2MLP" and type(getattr(module, "act",
                                                                 None)).__name__ == "NewGELUActivation":
            module.act = LeanGeluNew()
            counts["gelu"] += 1
    model._dsforge_kernels = on  # read by the runtime's loss (engine.CausalLMLoss)
    return counts
