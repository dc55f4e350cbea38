"""plan.json's `rewrite` section: the runtime's rewrite plan, computed at compile time where torch is installed.

The rewrite plan (which module becomes which parallel variant, its shard shapes, the exact parameter
counts) comes from ``dsforge.runtime.rewrite.describe``, which builds the model on torch's ``meta``
device. The compiler never imports torch at import time, so this module imports the runtime only inside
``rewrite_description``, after checking that it can; when it cannot (or compile runs with
``--no-rewrite``) the section records why it was skipped rather than vanishing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dsforge.compiler.plan import Plan
from dsforge.compiler.schema import JobSpec

#: The section of a compile that was asked not to compute it.
NO_REWRITE = {"skipped": "compile ran with --no-rewrite"}
INSTALL = "pip install 'dsforge[runtime]'"


def _missing(spec: JobSpec) -> str | None:
    """Why describe() cannot run here, or None: torch (and, for HF-built models, transformers) must import."""
    needed = ["torch"] if spec.model.factory else ["torch", "transformers"]
    absent = [m for m in needed if importlib.util.find_spec(m) is None]
    if absent:
        return f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed here ({INSTALL})"
    if spec.model.factory:
        module = spec.model.factory.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is absent or not a package
            found = False
        if not found:  # the factory's package may exist only where the job runs: not an error here
            return f"model.factory module {module!r} cannot be imported here"
    return None


def rewrite_description(spec: JobSpec, plan: Plan) -> tuple[dict[str, Any], str | None]:
    """describe(spec, plan), or ``{"skipped": why}``; and the internal error, if describe raised (it never should).

    Never raises: a missing torch is a recorded skip, a bug in the planner costs only this section.
    """
    if plan.degrees is None:  # DSF600 reports the unresolved degrees
        return {"skipped": "the parallel degrees are not resolved"}, None
    missing = _missing(spec)
    if missing:
        return {"skipped": missing}, None
    try:
        from dsforge.runtime.rewrite import describe
    except ImportError as exc:
        return {"skipped": f"dsforge.runtime cannot be imported here: {exc}"}, None
    try:
        return describe(spec, plan), None
    except Exception as exc:  # noqa: BLE001 - isolation is the point, as for rules
        reason = f"{type(exc).__name__}: {exc}"
        return {"skipped": f"the rewrite planner failed: {reason}"}, reason


def with_exact_params(summary: dict[str, Any], desc: dict[str, Any]) -> dict[str, Any]:
    """The explain summary with the rewrite plan's exact parameter counts in place of the formula's.

    ``params.total`` and each stage's ``exact`` count come from the module tree; the formula's figures
    stay beside them (``formula_total``, ``dense`` + ``expert``) so a reader sees where they differ.
    A summary is returned unchanged unless the rewrite plan is ``ok``.
    """
    if not desc.get("ok") or "params" not in summary:
        return summary
    params, exact = dict(summary["params"]), desc["params"]
    formula = params["total"]
    params.update(total=exact["total"], formula_total=formula, source="rewrite plan (exact)")
    if params.get("active_per_token") == formula:  # a dense model: every parameter is active
        params["active_per_token"] = exact["total"]
    params["per_gpu_by_stage"] = [{**row, "exact": n}
                                  for row, n in zip(params.get("per_gpu_by_stage", []), exact["per_rank_by_stage"])]
    return {**summary, "params": params}
