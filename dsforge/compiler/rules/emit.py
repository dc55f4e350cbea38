"""DSF600 and DSF69x: what only `dsforge compile` can find, and the emitter's own failures."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.rules.registry import Context, Finding, report_id, rule
from dsforge.diagnostics import Severity


@rule("DSF600", "compile needs concrete degrees and ZeRO stage", source="dsforge emit", phase="compile")
def _unresolved(ctx: Context) -> Iterator[Finding]:
    """A job directory runs one concrete layout; only `parallel.dp: auto` is resolved today (from the world
    size over tp x pp x cp), so every other degree and the ZeRO stage must be written as a number."""
    par = ctx.spec.parallel
    for key in ("tp", "pp", "cp", "ep", "zero"):
        if getattr(par, key) == "auto":
            yield Finding(f"parallel.{key} is `auto`; compile needs a concrete value",
                          f"set parallel.{key} to a number (`dsforge explain` "
                          f"with a few values compares them)", ("parallel", key))


report_id("DSF690", "the explain summary of plan.json could be computed",
          "compile embeds the cost model's summary in plan.json; when the cost model fails on a valid job "
          "the directory is still written without it, and this warning says why. Please report it.",
          "dsforge", severity=Severity.WARNING)
report_id("DSF699", "the job directory can be emitted",
          "Rendering a file of the job directory failed (a plugin launch target raised or returned the wrong "
          "thing, a Kubernetes ConfigMap over 1 MiB, a value the emitter cannot write); nothing is written.",
          "dsforge/compiler/emit (job_dir.py, launchers.py)")
