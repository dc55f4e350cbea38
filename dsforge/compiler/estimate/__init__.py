"""Cost estimates of a plan (pure: no torch, no deepspeed). Memory: `estimate_memory`."""

from dsforge.compiler.estimate.memory import MemoryEstimate, StageMemory, estimate_memory

__all__ = ["MemoryEstimate", "StageMemory", "estimate_memory"]
