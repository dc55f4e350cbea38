"""The rewrite plan of a job, from the runtime: the one place where compile and explain join the compiler to
it.

The rewrite plan (which module becomes which parallel variant, its shard shapes, the exact parameter
counts) comes from ``dsforge.runtime.rewrite.describe``, which builds the model on torch's ``meta``
device. The compiler never imports the runtime, so this command module imports it only inside
``rewrite_description``, after checking that it can; when it cannot (or compile runs with
``--no-rewrite``) the section records why it was skipped rather than vanishing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.spec.schema import JobSpec

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
    """describe(spec, plan), or ``{"skipped": why}``; and the internal error, if describe raised (it never
    should).

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
