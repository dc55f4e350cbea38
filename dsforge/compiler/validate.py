"""`validate`: load, parse, plan and check one job file, collecting every diagnostic."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsforge.compiler.parse import LoadedJob, load_job
from dsforge.compiler.plan import Plan, build_plan
from dsforge.compiler.rules.registry import Context, Rule, run_rules
from dsforge.diagnostics import Diagnostic, InputError


@dataclass
class Result:
    """The outcome for one file: its diagnostics, and the job and plan when it got that far."""

    file: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    job: LoadedJob | None = None
    plan: Plan | None = None
    unusable: bool = False


def check(job: LoadedJob, rules: list[Rule] | None = None) -> tuple[Plan, list[Diagnostic]]:
    """Plan a loaded job and run the rules over it."""
    plan = build_plan(job.spec)
    return plan, run_rules(Context(job.spec, plan, job.source, job.raw), rules)


def validate_file(path: str | Path, rules: list[Rule] | None = None) -> Result:
    """Validate one job file; never raises for bad input (unusable files come back flagged)."""
    result = Result(str(path))
    try:
        job, diags = load_job(path)
    except InputError as exc:
        result.diagnostics, result.unusable = exc.diagnostics, True
        return result
    if job is None:
        result.diagnostics = diags
        return result
    result.job = job
    result.plan, result.diagnostics = check(job, rules)
    return result
