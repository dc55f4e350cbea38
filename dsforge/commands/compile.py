"""`compile`: validate a job file, run the emit checks, render the job directory and write it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsforge.commands.rewrite import rewrite_description
from dsforge.compiler.emit.ds_config import EmitError
from dsforge.compiler.emit.job_dir import render_job
from dsforge.compiler.emit.plan_doc import summarize_safely
from dsforge.compiler.emit.rewrite_doc import NO_REWRITE, meta_count_note, with_exact_params
from dsforge.compiler.emit.writer import TargetError, check_target, recover, write_job_dir
from dsforge.compiler.frontend.parse import LoadedJob
from dsforge.compiler.plan.plan import Plan, UnresolvedPlan
from dsforge.compiler.rules.registry import checks, run_rules
from dsforge.compiler.rules.rewrite import RewriteContext
from dsforge.compiler.rules.selection import Selection, apply
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Diagnostic, Location, Severity, has_errors

__all__ = ["CompileResult", "TargetError", "compile_file"]


@dataclass
class CompileResult:
    """What compile did: its diagnostics, the directory and files it wrote (None/[] when it refused), and
    notes (what plan.json lacks and why, e.g. no rewrite plan without torch)."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    unusable: bool = False
    written: Path | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _rewrite_step(job: LoadedJob, plan: Plan, enabled: bool) -> tuple[dict[str, Any], list[Diagnostic],
                                                                      list[str]]:
    """plan.json's rewrite section, a DSF691 warning if the planner crashed, and a note when it was
    skipped."""
    if not enabled:
        return dict(NO_REWRITE), [], []
    section, failure = rewrite_description(job.spec, plan)
    if failure is not None:
        return (
            section,
            [
                Diagnostic(
                    "DSF691",
                    Severity.WARNING,
                    f"plan.json carries no rewrite plan: the rewrite planner failed on this job ({failure})",
                    Location(job.source.file),
                    "report it; the job directory is complete otherwise",
                )
            ],
            [],
        )
    return (
        section,
        [],
        ([f"plan.json has no rewrite plan: {section['skipped']}"] if "skipped" in section else []),
    )


def _cannot_emit(job: LoadedJob, exc: Exception) -> Diagnostic:
    """DSF699: the emitter refused the plan (the message says why)."""
    return Diagnostic("DSF699", Severity.ERROR, f"cannot emit the job: {exc}", Location(job.source.file),
                      "fix the job file as the message says")


def compile_file(path: str | Path, out: str | Path, force: bool = False, rewrite: bool = True,
                 selection: Selection | None = None) -> CompileResult:
    """Compile one job file into the directory ``out``; nothing is written when any error is found.

    ``rewrite``: compute the rewrite plan (imports torch and transformers, seconds) for plan.json and
    check that it places every module (DSF607); False records it as skipped. Raises TargetError when
    ``out`` may not be written (checked before and again while writing): it is the working directory
    or above it, its parent does not exist, or it holds what an earlier compile did not write. What a
    compile of ``out`` that was killed left beside it is repaired first (a note says so).
    """
    target = Path(os.path.abspath(out))
    repairs = recover(target)  # what a compile killed while replacing this target left behind
    try:
        check_target(target, force)
    except TargetError as exc:
        if not repairs:
            raise
        raise TargetError(f"{exc} (first {'; '.join(repairs)})") from None
    result = validate_file(path, selection=selection)
    if result.unusable or result.job is None or result.plan is None:
        return CompileResult(result.diagnostics, unusable=result.unusable, notes=repairs)
    job, plan = result.job, result.plan
    # A job with validation errors gets no rewrite plan: it would only restate them, and costs seconds.
    section, diags, notes = _rewrite_step(job, plan, rewrite and not has_errors(result.diagnostics))
    notes = repairs + notes
    ctx = RewriteContext(job.spec, plan, job.source, job.raw, rewrite=section)
    # the same selection as validate's; its problems (unknown ids, ...) were reported there already
    compile_only = apply(run_rules(ctx, checks("compile")), result.selection, job.source.ignores, notes=False)
    diags = result.diagnostics + compile_only.diagnostics + diags
    diags.sort(key=lambda d: (d.location.line, d.location.column, d.rule))
    if has_errors(diags):
        return CompileResult(diags, notes=notes)
    try:
        resolved = plan.resolve()  # validate's rules proved the layout: this holds for every job without
                                   # errors
    except UnresolvedPlan as exc:
        return CompileResult([*diags, _cannot_emit(job, exc)], notes=notes)
    summary, failure = summarize_safely(resolved)
    if summary is not None:
        summary = with_exact_params(summary, section)
        notes += meta_count_note(summary)
    if failure is not None:
        diags.append(Diagnostic("DSF690", Severity.WARNING, f"plan.json carries no explain summary: the cost "
                                f"model failed on this job ({failure})", Location(job.source.file),
                                "report it; the job directory is complete otherwise"))
    try:
        files = render_job(resolved, summary, section)
    except EmitError as exc:
        diags.append(_cannot_emit(job, exc))
        return CompileResult(diags, notes=notes)
    try:
        write_job_dir(target, files, force)
    except OSError as exc:  # a parent that is a file, no permission, a full disk: nothing was left behind
        raise TargetError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return CompileResult(diags, written=target, files=list(files), notes=notes)


def command(file: str, out: str, force: bool, fmt: str, no_rewrite: bool,
            selection: Selection | None) -> None:
    """`dsforge compile`: compile, print the diagnostics and what was written; exits with the command's
    code."""
    import sys

    import click

    from dsforge.commands import EXIT_FINDINGS, EXIT_UNUSABLE
    from dsforge.commands.preflight import lock_for_compile
    from dsforge.formatters import get
    from dsforge.runtime.run_lock import release_all

    click.get_current_context().call_on_close(release_all)
    try:
        lock_for_compile(out)  # a directory a run is using is never replaced under it (--force included)
        result = compile_file(file, out, force, rewrite=not no_rewrite, selection=selection)
    except TargetError as exc:
        click.echo(f"dsforge compile: {exc}", err=True)
        sys.exit(EXIT_UNUSABLE)
    click.echo(get(fmt)(result.diagnostics), nl=False)
    for note in result.notes:
        click.echo(f"dsforge compile: note: {note}", err=True)
    if result.unusable:
        sys.exit(EXIT_UNUSABLE)
    if result.written is None:
        click.echo("dsforge compile: nothing written: fix the errors above", err=True)
        sys.exit(EXIT_FINDINGS)
    click.echo(f"dsforge compile: wrote {out}: {', '.join(result.files)}", err=True)
