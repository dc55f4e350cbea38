"""The job's precision for the weights a model arrives with (`training.precision`, as the ds_config enables
it).

DeepSpeed casts the parameters of a bf16/fp16 job to that dtype and keeps fp32 master weights in its
optimizer (engine.py ``_configure_distributed_model``, the BF16/FP16 optimizers and ZeRO's fp32
partitions), but leaves an fp32 job's parameters as they come: a model loaded in bf16 (an HF checkpoint
read with its stored dtype, a user's ``from_pretrained(torch_dtype=...)``) would then train in bf16
with no fp32 master and no word said. Before the engine starts, dsforge therefore casts an fp32 job's
floating parameters to fp32 (exact from bf16 and fp16) and says so; for 16-bit jobs it says what
DeepSpeed's cast changes when the weights came in the other 16-bit dtype, and refuses an fp16 job whose
weights exceed fp16's range (the cast would make them infinite).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from dsforge.runtime.errors import EngineError

FP16_MAX = torch.finfo(torch.float16).max


class PrecisionError(EngineError):
    """The model's weights cannot be trained in the job's precision without changing them beyond rounding
    (an EngineError, so `dsforge run` reports it in one line)."""


def job_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The parameter dtype DeepSpeed trains with under ``ds_config`` (its bf16/fp16 sections)."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return dtype
    return torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def match_precision(module: nn.Module, dtype: torch.dtype) -> str | None:
    """Bring ``module``'s floating parameters to the job's ``dtype`` as described in the module doc.

    Returns the sentence the run prints when the weights arrived in another dtype, else None.
    """
    found = Counter(p.dtype for p in module.parameters() if p.is_floating_point() and p.device.type != "meta")
    other = {d: n for d, n in found.items() if d != dtype}
    if not other:
        return None
    came = ", ".join(f"{n} {_name(d)}" for d, n in sorted(other.items(), key=lambda kv: str(kv[0])))
    if dtype == torch.float16:
        for name, p in module.named_parameters():
            if p.is_floating_point() and p.dtype != dtype and p.device.type != "meta":
                top = float(p.detach().abs().max()) if p.numel() else 0.0
                if top > FP16_MAX:
                    raise PrecisionError(f"{name} holds {top:.3g}, beyond fp16's largest value "
                                         f"{FP16_MAX:.0f}: casting it for training.precision fp16 would make "
                                         f"it infinite; use training.precision bf16 (or fp32)")
    if dtype == torch.float32:
        with torch.no_grad():
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.float()  # in place on the Parameter: optimizers and ties see the same
                                             # object
        return (f"dsforge: the model's weights came as {came} parameter(s); cast to float32 (exact) for "
                "training.precision fp32")
    if all(d == torch.float32 for d in other):
        return None  # fp32 weights in a 16-bit job: the usual mixed-precision start, nothing to say
    return (f"dsforge: the model's weights came as {came} parameter(s); DeepSpeed casts them to "
            f"{_name(dtype)} for training.precision {'bf16' if dtype == torch.bfloat16 else 'fp16'} "
            f"(rounding them) and keeps fp32 master weights from the cast values")
