"""`dsforge explain`: estimate a valid job and print its tables or JSON summary, its pictures and HTML
report."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from dsforge.commands import EXIT_FINDINGS, EXIT_UNUSABLE

if TYPE_CHECKING:
    from dsforge.compiler.plan.plan import Plan


def command(file: str, fmt: str, plot_dir: str | None, html_path: str | None, tokens: float | None,
            with_rewrite: bool, selection: Any) -> None:
    """Explain ``file`` (exits 1 when the job has errors or the rewrite cannot place it, 2 on unusable
    input)."""
    from dsforge.compiler.validate import InvalidJob, require_valid
    from dsforge.diagnostics import Severity
    from dsforge.formatters import get

    try:
        result = require_valid(file, selection=selection)
    except InvalidJob as exc:
        click.echo(get(fmt)(exc.result.diagnostics), nl=False)
        sys.exit(EXIT_UNUSABLE if exc.result.unusable else EXIT_FINDINGS)
    # the layout search's choice for `auto` fields (DSF133) is said with the warnings: the estimate below is
    # of it
    warnings = [d for d in result.diagnostics if d.severity == Severity.WARNING or d.rule == "DSF133"]
    if warnings:
        click.echo(get("text")(warnings), nl=False, err=True)
    rewrite = _rewrite_plan(result.plan) if with_rewrite else None
    _explain_plan(result.plan, fmt, plot_dir, html_path, tokens, rewrite)
    if rewrite is not None and not rewrite["ok"]:
        click.echo("dsforge explain: the rewrite policies cannot "
                   "place the model (see the rewrite plan above)",
                   err=True)
        sys.exit(EXIT_FINDINGS)


def _rewrite_plan(plan: Plan) -> dict[str, Any]:
    """The rewrite plan's description for --rewrite; exits with a message where it cannot be computed."""
    from dsforge.commands.rewrite import rewrite_description

    desc, failure = rewrite_description(plan.spec, plan)
    if failure is not None:
        click.echo(f"dsforge explain: the rewrite planner failed on this job: {failure}", err=True)
        sys.exit(EXIT_FINDINGS)
    if "skipped" in desc:
        click.echo(f"dsforge explain: --rewrite cannot compute the rewrite plan: {desc['skipped']}", err=True)
        sys.exit(EXIT_UNUSABLE)
    return desc


def _explain_plan(plan: Plan, fmt: str, plot_dir: str | None, html_path: str | None, tokens: float | None,
                  rewrite: dict[str, Any] | None = None) -> None:
    from dsforge.compiler.estimate.schedule import ScheduleError
    from dsforge.compiler.estimate.steptime import EstimateError
    from dsforge.explain.report import explain_plan, write_outputs

    try:
        ex = explain_plan(plan.resolve(), tokens, rewrite)  # UnresolvedPlan is a ValueError
    except (EstimateError, ScheduleError, ValueError) as exc:
        click.echo(f"dsforge explain: cannot estimate this job: {exc}", err=True)
        sys.exit(EXIT_FINDINGS)
    from dsforge.compiler.strict_json import dumps, non_finite

    found = non_finite(ex.summary)
    if found is not None:  # strict JSON readers refuse NaN/Infinity, and no reader of the tables wants them
        click.echo(f"dsforge explain: cannot estimate this job: the "
                   f"cost model computed {found[1]} for {found[0]}",
                   err=True)
        sys.exit(EXIT_FINDINGS)
    if fmt == "json":
        click.echo(dumps(ex.summary, indent=2))
    else:
        from dsforge.explain.text import render

        click.echo(render(ex.summary), nl=False)
    if plot_dir or html_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("dsforge explain: --plot and --html need matplotlib: pip install 'dsforge[plots]'",
                       err=True)
            sys.exit(EXIT_UNUSABLE)
    if plot_dir or html_path:
        paths = write_outputs(ex, plot_dir, html_path)
        click.echo(f"dsforge explain: wrote {', '.join(str(p) for p in paths)}", err=True)
