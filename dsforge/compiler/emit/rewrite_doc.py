"""plan.json's `rewrite` section: the runtime's rewrite plan, computed at compile time where torch is
installed.

The plan itself comes from the runtime through ``dsforge.commands.rewrite`` (the compiler never imports
the runtime); this module holds what the emitter does with it: the section of a compile run with
``--no-rewrite``, and the explain summary with the plan's exact parameter counts.
"""

from __future__ import annotations

from typing import Any

#: The section of a compile that was asked not to compute it.
NO_REWRITE = {"skipped": "compile ran with --no-rewrite"}


def meta_count_note(summary: dict[str, Any]) -> list[str]:
    """A note when the meta build's exact parameter count differs from the estimate's (what the cost model
    priced)."""
    params = summary.get("params") or {}
    exact, formula = params.get("total"), params.get("formula_total")
    if formula is None or exact == formula or not isinstance(exact, int) or not exact:
        return []
    return [(f"the meta build counts {exact:,} parameters, the estimates {formula:,} (off by "
             f"{formula - exact:+,}, {(formula - exact) / exact:+.2%}): plan.json's parameter counts are the "
             f"meta build's, its memory and time estimates priced the estimates' model")]


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
                                  for row,
                                  n in zip(params.get("per_gpu_by_stage", []), exact["per_rank_by_stage"])]
    return {**summary, "params": params}
