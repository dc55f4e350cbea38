"""DSF3xx: memory per rank against the accelerator (the estimate of dsforge/compiler/estimate/memory.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsforge.compiler.estimate.memory import MemoryEstimate, StageMemory, estimate_memory
from dsforge.compiler.estimate.memory_fixes import (
    ErrorCheck,
    ErrorKey,
    FixSearch,
    MemoryFix,
    combined_fix,
    ranked_fixes,
)
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.rules.registry import Context, Finding, checks, rule, run_rules
from dsforge.compiler.spec.schema import JobSpec
from dsforge.diagnostics import Severity

WARN_ABOVE = 0.90
SOURCE = ("Rajbhandari et al. 2020 (ZeRO) sec. 3-5; Korthikanti et al. 2022 sec. 4; DeepSpeed 0.19.8 "
          "runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py, fp16/; measured in "
          "tests/compiler/estimate/test_memory_measured.py")


def gb(n: float) -> str:
    """Bytes as GB (1e9) with one decimal, the unit of `hardware.accelerator.memory_gb`."""
    return f"{n / 1e9:.1f} GB"


def breakdown(stage: StageMemory) -> str:
    """The non-zero device components of a stage, largest first, e.g. "optimizer 35.3 GB, ..."."""
    parts = sorted(((k, v) for k, v in stage.components.items() if v >= 0.05e9), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {gb(v)}" for k, v in parts)
    if stage.host_bytes:
        text += f"; on the host: {gb(stage.host_bytes)}"
    return text


def _estimable(ctx: Context) -> bool:
    """The estimate needs a valid, fully resolved layout; otherwise other rules explain what is wrong."""
    p = ctx.plan
    return (p.layout_ok and p.placement is not None and bool(p.stage_layers)
            and ctx.spec.parallel.zero != "auto")


def _error_check(ctx: Context) -> ErrorCheck:
    """The errors (rule id, key) a changed job has in every validate check but the memory rules'."""
    others = [r for r in checks("validate") if not r.id.startswith(("DSF3", "DSF9"))]

    def errors(spec: JobSpec, plan: Plan) -> frozenset[ErrorKey]:
        diags = run_rules(Context(spec, plan, ctx.source, ctx.raw), others)
        return frozenset((d.rule, tuple(d.path)) for d in diags if d.severity is Severity.ERROR)

    return errors


def _describe(f: MemoryFix) -> str:
    peak = f.estimate.peak.device_bytes
    return f"{f.change} saves {gb(f.saving_bytes)} (peak {gb(peak)}, {f.estimate.utilization:.0%})"


def _fix_text(fixes: list[MemoryFix], combined: MemoryFix | None, over: bool) -> str:
    parts = [_describe(f) for f in fixes]
    if combined is not None:
        parts.append(f"together: {_describe(combined)}")
    elif over and not any(f.fits for f in fixes):
        parts.append("no legal combination of these changes fits: use more or larger accelerators")
    elif not parts:
        parts.append("no single legal change lowers the peak: keep an eye on fragmentation, or use larger "
                     "accelerators")
    return "; ".join(parts)


def _details(est: MemoryEstimate, fixes: list[MemoryFix]) -> dict[str, Any]:
    peak = est.peak
    return {"stage": peak.stage, "rank": peak.rank, "phase": peak.phase, "capacity_bytes": est.capacity_bytes,
            "peak_bytes": peak.device_bytes, "utilization": est.utilization,
            "components": dict(peak.components), "host": dict(peak.host),
            "assumptions": list(est.assumptions),
            "fixes": [{"change": f.change, "saving_bytes": f.saving_bytes,
                       "peak_bytes": f.estimate.peak.device_bytes, "fits": f.fits} for f in fixes]}


@rule("DSF301", "the busiest rank's memory fits the accelerator", source=SOURCE, suppressible=True)
def memory_fits(ctx: Context) -> Iterator[Finding]:
    """Every rank must hold its share of weights, gradients and optimizer state (by ZeRO stage and
    precision, with DeepSpeed's real buffers), the activations of the micro-batches its pipeline
    stage keeps in flight, the logits on the last stage and a framework reserve. The busiest stage
    decides: over the accelerator's memory is an out-of-memory crash after the job has queued and
    started; above 90 % leaves no room for fragmentation spikes. Fixes are priced by re-estimating the
    changed job and offered only if the change itself brings no error in the other checks; an error the
    job already had (its own diagnostic) disqualifies no fix."""
    if not _estimable(ctx):
        return
    est = estimate_memory(ctx.plan.priced())
    if est.utilization <= WARN_ABOVE:
        return
    peak = est.peak
    over = est.utilization > 1.0
    search = FixSearch.of(ctx.spec, ctx.plan, est, _error_check(ctx))
    fixes = ranked_fixes(search, limit=5 if over else 3)
    combined = None
    if over and not any(f.fits for f in fixes):
        combined = combined_fix(search, first=fixes)
    where = f"pipeline stage {peak.stage} (rank {peak.rank})" if len(est.stages) > 1 else f"rank {peak.rank}"
    verdict = "does not fit" if over else f"uses {est.utilization:.0%} of"
    moment = "during backward" if peak.phase == "backward" else "in the optimizer update"
    message = (f"{where} needs {gb(peak.device_bytes)} at its peak ({moment}) and {verdict} the "
               f"{gb(est.capacity_bytes)} of {ctx.spec.hardware.accelerator.name}: {breakdown(peak)}")
    shown = fixes if combined is None else [*fixes, combined]
    yield Finding(message, _fix_text(fixes, combined, over), ("parallel", "zero"),
                  severity=None if over else Severity.WARNING, details=_details(est, shown))
