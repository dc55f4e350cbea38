"""The `dsforge` command line: one command per verb. Heavy modules load only inside their command."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dsforge import __version__

if TYPE_CHECKING:
    from dsforge.compiler.plan import Plan

EXIT_CLEAN, EXIT_FINDINGS, EXIT_UNUSABLE = 0, 1, 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dsforge")
def cli() -> None:
    """Compile a declarative YAML job file into a checked, explained, runnable DeepSpeed job."""


@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "github", "sarif"]), default="text",
              show_default=True, help="Output format of the diagnostics.")
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the report here instead of stdout.")
def validate(files: tuple[str, ...], fmt: str, strict: bool, output: str | None) -> None:
    """Check job files against the schema, the hardware and DeepSpeed's rules.

    Exit codes: 0 clean, 1 findings (errors, or warnings with --strict), 2 unusable input.
    """
    from dsforge.compiler.validate import validate_file
    from dsforge.diagnostics import has_errors
    from dsforge.formatters import get, write_report

    results = [validate_file(f) for f in files]
    diags = [d for r in results for d in r.diagnostics]
    text = get(fmt)(diags)
    if output:
        problem = write_report(text, output)
        if problem:
            click.echo(f"dsforge: {problem}", err=True)
            sys.exit(EXIT_UNUSABLE)
    else:
        click.echo(text, nl=False)
    if any(r.unusable for r in results):
        sys.exit(EXIT_UNUSABLE)
    sys.exit(EXIT_FINDINGS if has_errors(diags, strict) else EXIT_CLEAN)


@cli.command()
def schema() -> None:
    """Print the JSON Schema of job files (for editors' YAML language servers)."""
    from dsforge.compiler.json_schema import job_schema

    click.echo(json.dumps(job_schema(), indent=2))


@cli.command()
@click.option("--kind", type=click.Choice(["all", "hardware", "models"]), default="all", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def presets(kind: str, fmt: str) -> None:
    """List the hardware and model presets."""
    from dsforge.compiler.presets import KINDS
    from dsforge.compiler.presets import presets as table

    kinds = KINDS if kind == "all" else (kind,)
    if fmt == "json":
        click.echo(json.dumps({k: {n: {"description": p.description, "origin": p.origin, "spec": p.spec}
                                   for n, p in table(k).items()} for k in kinds}, indent=2))
        return
    for k in kinds:
        click.echo(f"{k}:")
        for name, p in table(k).items():
            click.echo(f"  {name:<16} {p.description}")


@cli.command(name="compile")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="The job directory to write (absent or empty).")
@click.option("--force", is_flag=True, help="Replace a job directory an earlier compile wrote (nothing else).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "github", "sarif"]), default="text",
              show_default=True, help="Output format of the diagnostics.")
@click.option("--no-rewrite", is_flag=True, help="Skip the rewrite plan (it imports torch and transformers, which "
              "takes seconds); plan.json records it as skipped and DSF607 is not checked.")
def compile_job(file: str, out: str, force: bool, fmt: str, no_rewrite: bool) -> None:
    """Compile a job file into a runnable job directory (ds_config.json, plan.json, launcher, train.py).

    Where torch is installed, plan.json carries the rewrite plan (which module becomes which parallel
    variant, exact parameter counts) and a model the policies cannot place is an error (DSF607).
    Nothing is written when the job has errors. Exit codes: 0 written, 1 errors in the job,
    2 unusable input or an output directory that may not be written.
    """
    from dsforge.compiler.emit.compile import TargetError, compile_file
    from dsforge.formatters import get

    try:
        result = compile_file(file, out, force, rewrite=not no_rewrite)
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


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Text tables, or the JSON summary that compile embeds in plan.json.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False),
              help="Write timeline, memory and placement pictures (PNG and SVG) into this directory.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write one self-contained HTML report.")
@click.option("--tokens", type=click.FloatRange(min=1), help="Training horizon for time-to-train "
              "(default: training.steps x tokens per step).")
@click.option("--rewrite", "with_rewrite", is_flag=True, help="Also show the rewrite plan (module -> parallel "
              "variant, shards per rank) and use its exact parameter counts; needs torch and transformers.")
def explain(file: str, fmt: str, plot_dir: str | None, html_path: str | None, tokens: float | None,
            with_rewrite: bool) -> None:
    """Estimate a job: parameters, FLOPs, memory per stage, communication per group, bubble, step time, MFU.

    Exit codes as validate: 0 explained, 1 the job has errors (they are printed; with --rewrite, also a
    model the rewrite policies cannot place), 2 unusable input (or --rewrite without torch).
    Warnings go to stderr and do not stop the estimate.
    """
    from dsforge.compiler.validate import validate_file
    from dsforge.diagnostics import Severity, has_errors
    from dsforge.formatters import get

    result = validate_file(file)
    if result.unusable or has_errors(result.diagnostics, False) or result.plan is None:
        click.echo(get(fmt)(result.diagnostics), nl=False)
        sys.exit(EXIT_UNUSABLE if result.unusable else EXIT_FINDINGS)
    warnings = [d for d in result.diagnostics if d.severity == Severity.WARNING]
    if warnings:
        click.echo(get("text")(warnings), nl=False, err=True)
    rewrite = _rewrite_plan(result.plan) if with_rewrite else None
    _explain_plan(result.plan, fmt, plot_dir, html_path, tokens, rewrite)
    if rewrite is not None and not rewrite["ok"]:
        click.echo("dsforge explain: the rewrite policies cannot place the model (see the rewrite plan above)",
                   err=True)
        sys.exit(EXIT_FINDINGS)


def _rewrite_plan(plan: Plan) -> dict[str, Any]:
    """The rewrite plan's description for --rewrite; exits with a message where it cannot be computed."""
    from dsforge.compiler.emit.rewrite_doc import rewrite_description

    desc, failure = rewrite_description(plan.spec, plan)
    if failure is not None:
        click.echo(f"dsforge explain: the rewrite planner failed on this job: {failure}", err=True)
        sys.exit(EXIT_FINDINGS)
    if "skipped" in desc:
        click.echo(f"dsforge explain: --rewrite cannot compute the rewrite plan: {desc['skipped']}", err=True)
        sys.exit(EXIT_UNUSABLE)
    return desc


def _explain_plan(plan: object, fmt: str, plot_dir: str | None, html_path: str | None, tokens: float | None,
                  rewrite: dict[str, Any] | None = None) -> None:
    from dsforge.compiler.estimate.schedule import ScheduleError
    from dsforge.compiler.estimate.steptime import EstimateError
    from dsforge.explain.report import explain_plan, write_outputs

    try:
        ex = explain_plan(plan, tokens, rewrite)  # type: ignore[arg-type]
    except (EstimateError, ScheduleError, ValueError) as exc:
        click.echo(f"dsforge explain: cannot estimate this job: {exc}", err=True)
        sys.exit(EXIT_FINDINGS)
    if fmt == "json":
        click.echo(json.dumps(ex.summary, indent=2))
    else:
        from dsforge.explain.text import render

        click.echo(render(ex.summary), nl=False)
    if plot_dir or html_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("dsforge explain: --plot and --html need matplotlib: pip install 'dsforge[plots]'", err=True)
            sys.exit(EXIT_UNUSABLE)
    if plot_dir or html_path:
        paths = write_outputs(ex, plot_dir, html_path)
        click.echo(f"dsforge explain: wrote {', '.join(str(p) for p in paths)}", err=True)


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def plugins(fmt: str) -> None:
    """List installed plugins (presets, rules, rewrite policies, launchers), where each came from, what it added.

    A plugin that fails to load is listed with its error and skipped. Exit codes: 0 every plugin
    loaded (or none is installed), 1 at least one failed.
    """
    from dsforge.plugins.report import plugin_report, render_text

    report = plugin_report()
    click.echo(json.dumps(report, indent=2) if fmt == "json" else render_text(report), nl=fmt == "json")
    sys.exit(EXIT_FINDINGS if report["failed"] else EXIT_CLEAN)


@cli.command(name="run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(file_okay=False),
              help="The job directory (default: runs/<job name>).")
@click.option("--fresh", is_flag=True, help="Discard an earlier run in the job directory (checkpoints, reports).")
def run_job(file: str, out: str | None, fresh: bool) -> None:
    """Compile a job file and train it on this machine with its local launcher (needs torch and deepspeed).

    An earlier run of the same compile in the job directory resumes from its checkpoints. Exit codes:
    0 trained, 1 errors in the job or a failed run, 2 unusable input or no runtime installed.
    """
    from dsforge.runner import INSTALL_HINT, RunError, launch, missing_runtime, prepare

    missing = missing_runtime()
    if missing:
        click.echo(f"dsforge run: this Python has no {', '.join(missing)}; install the runtime: {INSTALL_HINT}",
                   err=True)
        sys.exit(EXIT_UNUSABLE)
    try:
        prepared = prepare(file, out, fresh)
        click.echo(prepared.report, nl=False)
        verb = "resuming the earlier run in" if prepared.reused else "compiled into"
        click.echo(f"dsforge run: {verb} {prepared.job_dir}", err=True)
        code = launch(prepared.job_dir)
    except RunError as exc:
        click.echo(exc.report, nl=False)
        click.echo(f"dsforge run: {exc}", err=True)
        sys.exit(exc.code)
    if code != 0:
        click.echo(f"dsforge run: the job failed (exit code {code}); see {prepared.job_dir}", err=True)
        sys.exit(EXIT_FINDINGS)


def main() -> NoReturn:
    """Console entry point: run the CLI; an unexpected exception is reported without a traceback."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_UNUSABLE)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # the user gets a message, not a traceback
        click.echo(f"dsforge: internal error: {type(exc).__name__}: {exc} (set DSFORGE_DEBUG=1 for the traceback)",
                   err=True)
        if os.environ.get("DSFORGE_DEBUG"):
            raise
        sys.exit(EXIT_UNUSABLE)
    sys.exit(EXIT_CLEAN)
