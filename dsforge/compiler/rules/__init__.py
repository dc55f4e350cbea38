"""Validation rules over a job: registry, runner, and the built-in checks (one module per stage)."""

from __future__ import annotations

import importlib

_BUILTIN = ("layout", "model_shape", "batch", "topology", "deepspeed_compat", "ds_overrides", "memory")
_loaded = False


def load_builtin() -> None:
    """Import the built-in rule modules once (each registers its rules on import)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in _BUILTIN:
        importlib.import_module(f"dsforge.compiler.rules.{name}")
    from dsforge.plugins.registry import ensure_loaded

    ensure_loaded("rules")  # rules of installed plugins (entry points `dsforge.rules`)
    # DSF701 reports plugins that failed to load (nothing when all loaded); it is registered either way so
    # the rule set, and docs/rules.md generated from it, do not depend on the installation.
    from dsforge.plugins.extensions import report_failed_plugins

    report_failed_plugins()
