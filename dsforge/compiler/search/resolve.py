"""`auto` where validate, explain and compile meet it: the same search as `dsforge search`, its winner planned
and checked like any written layout, the choice stated (DSF133) and recorded in plan.json; what the search
cannot resolve is an error with a rule id (DSF120, DSF130, DSF131, DSF132)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsforge.compiler.frontend.parse import LoadedJob
from dsforge.compiler.rules.selection import Selection, apply
from dsforge.compiler.search.engine import (
    Evaluated,
    RuleFilter,
    SearchResult,
    SpaceTooLarge,
    rule_errors,
    search,
)
from dsforge.compiler.search.space import auto_keys, is_auto, options, value_at
from dsforge.diagnostics import Diagnostic, Severity


@dataclass
class Resolution:
    """The job with its `auto` fields resolved (or None), the search, and what to report."""

    job: LoadedJob | None
    result: SearchResult | None
    diagnostics: list[Diagnostic] = field(default_factory=list)


def _diag(rule: str, job: LoadedJob, path: tuple[str, ...], message: str, fix: str,
          severity: Severity = Severity.ERROR) -> Diagnostic:
    loc = job.source.locate(path, value=True)
    return Diagnostic(rule, severity, message, loc, fix, path)


def unresolvable(job: LoadedJob) -> list[Diagnostic]:
    """What the search cannot resolve: `nodes: auto` without objective min_gpus, an objective without its
    inputs."""
    spec, o = job.spec, options(job.spec)
    out = []
    if is_auto(spec, ("hardware", "nodes")) and o.objective != "min_gpus":
        out.append(_diag("DSF120", job, ("hardware", "nodes"),
                         f"hardware.nodes is `auto` with objective {o.objective}: more GPUs are always "
                         f"faster, so only the fewest GPUs that meet a "
                         f"deadline is a question the search can answer",
                         "set hardware.nodes to a number, or set search.objective: min_gpus and "
                         "search.deadline_hours"))
    if o.objective == "min_gpus" and o.deadline_hours is None:
        out.append(_diag("DSF131", job, ("search", "objective"), "objective min_gpus needs a deadline",
                         "set search.deadline_hours (and search.tokens, the budget to train within it)"))
    if o.objective == "cost" and o.price_per_gpu_hour is None:
        out.append(_diag("DSF131", job, ("search", "objective"), "objective cost needs a price",
                         "set search.price_per_gpu_hour"))
    return out


def rule_filter(job: LoadedJob, selection: Selection) -> RuleFilter:
    """validate's checks under validate's selection and inline comments, as the engine's error filter."""

    def keep(found: list[Diagnostic]) -> list[Diagnostic]:
        return apply(found, selection, job.source.ignores, notes=False).diagnostics

    return rule_errors(job, keep=keep)


def _lacks(result: SearchResult) -> str:
    shown, seen = [], set()
    for m in result.misses:
        if m.reason in seen and m.reason != "memory":
            continue
        seen.add(m.reason)
        shown.append(f"{m.layout.label()}: {m.reason} ({m.detail})")
        if len(shown) == 3:
            break
    return "; ".join(shown) if shown else "no candidate is legal by construction"


def no_fit(job: LoadedJob, result: SearchResult) -> Diagnostic:
    """DSF130 with the closest misses (and, for `nodes: auto`, the node counts tried)."""
    key = result.keys[0] if result.keys else ("parallel",)
    f = result.funnel
    removed = ", ".join(f"{k} {v}" for k, v in sorted(f.removed.items()))
    nodes = (f" on 1 to {result.nodes_tried[-1]} node(s)" if is_auto(job.spec,
                                                                     ("hardware",
                                                                      "nodes")) and result.nodes_tried
             else "")
    msg = (f"no layout for the `auto` fields fits{nodes}: {f.considered:,} candidate(s), removed: "
           f"{removed or 'none'}; closest: {_lacks(result)}")
    fix = ("use more or larger accelerators, fix a field the misses lack (memory: raise zero, pp or "
           "recompute), or relax search.memory_fraction / search.max_tp / search.deadline_hours")
    return _diag("DSF130", job, key, msg, fix)


def record(result: SearchResult, runners_up: int = 3) -> dict[str, Any]:
    """The search as plan.json records it: objective, keys, winner, runners-up and the funnel."""
    def entry(e: Evaluated) -> dict[str, Any]:
        return {"layout": e.layout.as_dict(), "value": e.value, "step_s": e.step.step_s,
                "tokens_per_s": e.step.tokens_per_s, "peak_bytes": e.memory.peak.device_bytes,
                "memory_utilization": e.memory.utilization}

    o = result.objective
    return {"objective": {"name": o.name, "tokens": o.tokens, "price_per_gpu_hour": o.price_per_gpu_hour,
                          "deadline_s": o.deadline_s, "unit": o.unit},
            "auto": [".".join(k) for k in result.keys],
            "winner": entry(result.ranked[0]) if result.ranked else None,
            "runners_up": [entry(e) for e in result.ranked[1:1 + runners_up]],
            "funnel": result.funnel.as_dict(), "exhaustive": result.exhaustive,
            "nodes_tried": len(result.nodes_tried)}


def chosen_note(job: LoadedJob, result: SearchResult) -> Diagnostic:
    """DSF133: the layout the search chose, its value, the runner-up."""
    w = result.ranked[0]
    keys = ", ".join(f"{'.'.join(k)}={_show(value_at(w.spec, k))}" for k in result.keys)
    why = (f"best {result.objective.name} of {result.funnel.considered:,} candidate(s): "
           f"{w.step.step_s:.3g} s/step, {w.step.tokens_per_s:,.0f} tokens/s, peak "
           f"{w.memory.utilization:.0%} of memory")
    if len(result.ranked) > 1:
        r = result.ranked[1]
        why += f"; runner-up {r.layout.label()} at {r.step.step_s:.3g} s/step"
    return _diag("DSF133", job, result.keys[0], f"the search chose {keys} ({why})",
                 "`dsforge search` shows the ranking; `--write FILE` writes these values into the job file",
                 Severity.INFO)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve(job: LoadedJob, selection: Selection | None = None) -> Resolution:
    """Resolve a job's `auto` fields with the search: the winner's job, or the diagnostics that say why
    not."""
    problems = unresolvable(job)
    if problems:
        return Resolution(None, None, problems)
    try:
        result = search(job, rule_filter(job, selection or Selection()))
    except SpaceTooLarge as exc:
        key = auto_keys(job.spec)[0] if auto_keys(job.spec) else ("parallel",)
        return Resolution(None, None, [_diag("DSF132", job, key, f"the layout search space holds {exc}",
                                             "fix some `auto` fields to numbers, or set search.max_tp")])
    if not result.ranked:
        return Resolution(None, result, [no_fit(job, result)])
    resolved = LoadedJob(result.ranked[0].spec, job.source, job.raw)
    return Resolution(resolved, result, [chosen_note(job, result)])
