"""DSF607 and DSF691: the rewrite plan compile computes (plan.json's `rewrite`) places every module of the
model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, report_id, rule
from dsforge.diagnostics import Severity

LEFTOVER_FIX = ("give each module named a `rewrite:` rule (as: column, row, vocab, norm, replicate or "
                "expert), or set model.arch to the family the model belongs to")
OTHER_FIX = "change the job as the message says; `dsforge explain --rewrite` prints the rewrite plan"


@dataclass(frozen=True)
class RewriteContext(Context):
    """A rule context that also carries the job's rewrite description (plan.json's `rewrite` section)."""

    rewrite: dict[str, Any] | None = None


def _path(ctx: Context) -> tuple[str, ...]:
    """Where the finding points: the job's `rewrite:` rules, else model.arch (or the model preset)."""
    return ("rewrite",) if ctx.written(("rewrite",)) else ("model", "arch")


@rule("DSF607", "the rewrite policies place every module of the model",
      source="dsforge.runtime.rewrite (describe, plan_rewrite); dsforge/compiler/model/rewrite_policies.py",
      phase="compile", stacks=DSFORGE_RUNTIME)
def _placed(ctx: Context) -> Iterator[Finding]:
    """dsforge.runtime rewrites the model by the rewrite policy of its family (`model.arch`) and the job's
    `rewrite:` rules; a module with parameters that no rule claims, a shard that does not divide, or a model
    that cannot be built would stop every rank at start-up, so compile refuses the job. The check reads the
    rewrite plan compile computes on the meta device when torch is installed (plan.json's `rewrite`); without
    torch, or with `--no-rewrite`, that plan is recorded as skipped and there is nothing to check."""
    desc = getattr(ctx, "rewrite", None)
    if not isinstance(desc, dict) or desc.get("ok", True):
        return
    leftover = list(desc.get("leftover") or [])
    for problem in desc.get("errors") or ["the model cannot be placed (no reason given)"]:
        names_leftover = bool(leftover) and problem.startswith("no rule places")
        yield Finding(f"the `{desc.get('arch')}` rewrite policy cannot place the model: {problem}",
                      LEFTOVER_FIX if names_leftover else OTHER_FIX, _path(ctx),
                      details={"arch": desc.get("arch"), "leftover": leftover} if names_leftover else {})


report_id("DSF691", "the rewrite plan of plan.json could be computed",
          "compile records the runtime's rewrite plan in plan.json where torch is installed; when the "
          "planner itself fails (rather than finding a module it cannot place, DSF607) the directory is "
          "still written without it, and this warning says why. Please report it.",
          "dsforge.runtime.rewrite (describe)", severity=Severity.WARNING)
