"""Validation rules over a job: the registry, its runner, and every stage's ids (one module per concern)."""

from __future__ import annotations

import importlib

_BUILTIN = ("input", "layout", "model_shape", "batch", "topology", "deepspeed_compat", "ds_overrides",
            "memory", "ds_job_values", "launch", "emit", "rewrite", "plugins", "internal", "paths",
            "pretrained", "runtime_support", "host_memory", "resume", "pipeline_split", "data_files",
            "lean_kernels", "machine", "stack_support", "hf_plans", "hf_params", "pretrained_pipeline")
_loaded = False


def load_builtin() -> None:
    """Import the built-in rule modules once (each registers its rules on import), then installed plugins'."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in _BUILTIN:
        importlib.import_module(f"dsforge.compiler.rules.{name}")
    from dsforge import extensions

    extensions.ensure_loaded("rules")  # rules of installed plugins (entry points `dsforge.rules`)
