"""The `dsforge` command line: the click declarations of each verb and their shared checks.

What a verb does is in its module of dsforge.commands, imported only when the verb runs (heavy modules
load only inside their command)."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click

from dsforge import __version__
from dsforge.commands import EXIT_CLEAN, EXIT_UNUSABLE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dsforge")
def cli() -> None:
    """Compile a declarative YAML job file into a checked, explained, runnable DeepSpeed job."""


def _selection_options(fn: Any) -> Any:
    """`--select` / `--ignore`: which rule ids to report (ids or prefixes, comma-separated, repeatable)."""
    fn = click.option("--ignore", "ignore", multiple=True, metavar="IDS",
                      help="Never report these rule ids or prefixes (e.g. DSF204,DSF4); adds to "
                           "[tool.dsforge] ignore. Errors stay unless their "
                           "rule may be silenced (docs/rules.md).")(fn)
    return click.option("--select", "select", multiple=True, metavar="IDS",
                        help="Report only these rule ids or prefixes (e.g. DSF1,DSF301); replaces "
                             "[tool.dsforge] select. Input errors (DSF0xx) are always reported.")(fn)


def _selection(select: tuple[str, ...], ignore: tuple[str, ...]) -> Any:
    """The command line's selection, or None when it names none (the project's settings then apply alone)."""
    from dsforge.compiler.rules.selection import Selection

    if not select and not ignore:
        return None
    try:
        return Selection.of(select, (), "--select").over(Selection.of((), ignore, "--ignore"))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--select/--ignore") from None


_FORMATS = ["text", "json", "github", "sarif", "gcc"]


def _finite_tokens(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """--tokens as a finite count (FloatRange lets `nan` through: every comparison with it is false)."""
    if value is not None and not 1 <= value <= 1e30:
        raise click.BadParameter(f"{value} is not a token count from 1 to 1e30", ctx, param)
    return value
_FORMAT_HELP = "Output format of the diagnostics (gcc: `file:line:col: error: message [ID]` for editors)."


@cli.command()
@_selection_options
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--format", "fmt", type=click.Choice(_FORMATS), default="text", show_default=True,
              help=_FORMAT_HELP)
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1); also "
                                             "`strict = true` in [tool.dsforge].")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the report here instead of stdout.")
def validate(files: tuple[str, ...], fmt: str, strict: bool, output: str | None, select: tuple[str, ...],
             ignore: tuple[str, ...]) -> None:
    """Check job files against the schema, the hardware and DeepSpeed's rules (`-` reads standard input).

    Exit codes: 0 clean, 1 findings (errors, or warnings with --strict), 2 unusable input.
    """
    if files.count("-") > 1:
        raise click.UsageError("`-` (standard input) can be read only once; give it at most once")
    from dsforge.commands import validate as command

    command.command(files, fmt, strict, output, _selection(select, ignore))


@cli.command()
def schema() -> None:
    """Print the JSON Schema of job files (for editors' YAML language servers)."""
    from dsforge.commands import schema as command

    command.command()


def _interactive() -> bool:
    """True when a person can answer prompts (standard input is a terminal)."""
    return sys.stdin is not None and sys.stdin.isatty()


@cli.command()
@click.option("--model", help="Model preset (`dsforge presets`)  [default: tiny-llama]")
@click.option("--hardware", help="Hardware preset  [default: cpu-local]")
@click.option("--nodes", type=click.IntRange(min=1), help="Nodes  [default: the fewest the model fits on]")
@click.option("--launcher", help="local, deepspeed, torchrun, slurm, kubernetes, accelerate or a plugin's "
              "launch target  [default: local on one node, slurm on several]")
@click.option("--name", help="Job name  [default: MODEL-HARDWARE]")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the job file here  [default: stdout]")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
def init(model: str | None, hardware: str | None, nodes: int | None, launcher: str | None, name: str | None,
         output: str | None, force: bool) -> None:
    """Write a commented starter job file whose layout validates clean (every key with its description).

    At a terminal, a missing --model or --hardware is asked for; otherwise the defaults train here
    (`dsforge run`). Exit codes: 0 written, 1 no layout of the model fits the hardware, 2 unusable
    choices or an output file that exists (without --force) or cannot be written.
    """
    from dsforge.commands import init as command

    command.command(model, hardware, nodes, launcher, name, output, force, _interactive())


@cli.command()
@click.option("--kind", type=click.Choice(["all", "hardware", "models"]), default="all", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def presets(kind: str, fmt: str) -> None:
    """List the hardware and model presets."""
    from dsforge.commands import presets as command

    command.command(kind, fmt)


@cli.command(name="compile")
@_selection_options
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="The job directory to write (absent or empty).")
@click.option("--force", is_flag=True,
              help="Replace a job directory an earlier compile wrote (nothing else).")
@click.option("--format", "fmt", type=click.Choice(_FORMATS), default="text", show_default=True,
              help=_FORMAT_HELP)
@click.option("--no-rewrite", is_flag=True, help="Skip the rewrite plan (it imports torch and transformers, "
              "which takes seconds); plan.json records it as skipped and DSF607 is not checked.")
def compile_job(file: str, out: str, force: bool, fmt: str, no_rewrite: bool, select: tuple[str, ...],
                ignore: tuple[str, ...]) -> None:
    """Compile a job file (`-`: standard input) into a runnable job directory (ds_config.json, plan.json,
    launcher, train.py).

    Where torch is installed, plan.json carries the rewrite plan (which module becomes which parallel
    variant, exact parameter counts) and a model the policies cannot place is an error (DSF607).
    Nothing is written when the job has errors. Exit codes: 0 written, 1 errors in the job,
    2 unusable input or an output directory that may not be written.
    """
    from dsforge.commands import compile as command

    command.command(file, out, force, fmt, no_rewrite, _selection(select, ignore))


@cli.command()
@_selection_options
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Text tables, or the JSON summary that compile embeds in plan.json.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False),
              help="Write timeline, memory and placement pictures (PNG and SVG) into this directory.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Write one self-contained HTML report.")
@click.option("--tokens", type=click.FloatRange(min=1), callback=_finite_tokens, help="Training horizon for "
              "time-to-train (default: training.steps x tokens per step; at most 1e30).")
@click.option("--rewrite", "with_rewrite", is_flag=True,
              help="Also show the rewrite plan (module -> parallel "
                  "variant, shards per rank) and use its exact "
                  "parameter counts; needs torch and transformers.")
def explain(file: str, fmt: str, plot_dir: str | None, html_path: str | None, tokens: float | None,
            with_rewrite: bool, select: tuple[str, ...], ignore: tuple[str, ...]) -> None:
    """Estimate a job (`-`: read from standard input): parameters, FLOPs, memory per stage, communication per
    group, bubble, step time, MFU.

    Exit codes as validate: 0 explained, 1 the job has errors (they are printed; with --rewrite, also a
    model the rewrite policies cannot place), 2 unusable input (or --rewrite without torch).
    Warnings go to stderr and do not stop the estimate.
    """
    from dsforge.commands import explain as command

    command.command(file, fmt, plot_dir, html_path, tokens, with_rewrite, _selection(select, ignore))



@cli.command()
@_selection_options
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--top", type=click.IntRange(1, 1000), help="Candidates to show  [default: search.top, 5]")
@click.option(
    "--write",
    "write",
    type=click.Path(dir_okay=False),
    help="Write the job file with the winner's values in place of `auto` (comments and key order kept).",
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False),
    help="Write memory against throughput of every "
    "fitting candidate, the frontier marked (PNG and SVG; estimates every candidate).",
)
@click.option("--compare", is_flag=True, help="Search every field the search sets (degrees, ZeRO, SP, CP "
              "kind, schedule, chunks, micro-batch, recompute; the GPU count "
              "stays) and rank the file's own layout among them.")
@click.option("--exhaustive", is_flag=True, help="Estimate every candidate (no bound "
                                                 "pruning; same ranking, slower).")
@click.option("--verify", type=click.IntRange(1, 100), metavar="K", help="Run the top K and the last-ranked "
              "candidate with `dsforge run` here; print predicted "
              "against measured step time and peak memory.")
def search(file: str, fmt: str, top: int | None, write: str | None, plot_dir: str | None, compare: bool,
           exhaustive: bool, verify: int | None, select: tuple[str, ...], ignore: tuple[str, ...]) -> None:
    """Rank the layouts for a job's `auto` fields (tp, pp, dp, cp, ep, zero, sequence_parallel, micro_batch,
    recompute, ...) with validate's rules and the cost model; print the top, the funnel and the winner.

    Exit codes: 0 a layout fits, 1 none fits or the job has errors, 2 unusable input.
    """
    from dsforge.commands import search as command

    command.command(file, fmt, top, write, plot_dir, compare, exhaustive, verify, _selection(select, ignore))


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def plugins(fmt: str) -> None:
    """List installed plugins (presets, rules, rewrite policies, launchers), where each came from, what it
    added.

    A plugin that fails to load is listed with its error and skipped. Exit codes: 0 every plugin
    loaded (or none is installed), 1 at least one failed.
    """
    from dsforge.commands import plugins as command

    command.command(fmt)


@cli.command()
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), default="calibrated.yaml",
              show_default=True, help="The hardware file to write (a `hardware:` fragment for `extends:`).")
@click.option("--ranks", type=click.IntRange(2, 64), default=2, show_default=True,
              help="Processes (or GPUs) the collectives are measured over, on this node.")
@click.option("--links-only", is_flag=True, help="Measure only the links (intra- "
                                                 "and inter-node) and write them.")
def calibrate(out: str, ranks: int, links_only: bool) -> None:
    """Measure this machine's GEMM, memory and collective rates into a hardware file (needs torch).

    A job uses the file with `extends: <file>` or `hardware.preset: <file>`; see docs/cost-model.md for
    what each figure means. Started by torchrun on several nodes (one process per rank), it measures
    the link inside a node and the link between nodes apart, and rank 0 writes the file.
    """
    from dsforge.commands import calibrate as command

    command.command(out, ranks, links_only)


@cli.command(name="run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(file_okay=False),
              help="The job directory (default: runs/<job name>).")
@click.option("--fresh", is_flag=True, help="Discard an earlier run in the job "
                                            "directory (checkpoints, reports).")
def run_job(file: str, out: str | None, fresh: bool) -> None:
    """Compile a job file and train it on this machine with its local launcher (needs torch and deepspeed).

    An earlier run of the same compile in the job directory resumes from its checkpoints. To train a
    finished run longer, raise training.steps in the job file and run it again: the job directory's
    files are re-written and training continues from the last checkpoint (so do changes of
    checkpoint.every, logging and launch settings; any other change needs --fresh or -o). Exit codes:
    0 trained, 1 errors in the job or a failed run, 2 unusable input or no runtime installed.
    """
    from dsforge.commands import run as command

    command.command(file, out, fresh)


@cli.command(name="export")
@click.argument("job_dir", type=click.Path(file_okay=False))
@click.option("--step", type=click.IntRange(min=1), help="The checkpoint of this optimizer "
                                                         "step  [default: the newest]")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="The HF model directory to write (must not exist, or be empty).")
def export_job(job_dir: str, step: int | None, out: str) -> None:
    """Write a checkpoint of a compiled job, whatever its layout (TP, PP, EP, ZeRO 0-3), as an HF model
    directory (config.json + model.safetensors) that transformers' from_pretrained loads.

    The directory appears whole or not at all. Exit codes: 0 written, 1 the checkpoint cannot be
    exported (the message says why), 2 no runtime installed.
    """
    from dsforge.commands import export as command

    command.command(job_dir, step, out)


def main() -> NoReturn:
    """Console entry point: run the CLI; an unexpected exception is reported without a traceback.

    Ctrl-C exits 130 and SIGTERM 143 (dsforge.interrupts), after the command's own cleanup ran.
    """
    from dsforge.interrupts import Terminated, catch_sigterm, exit_code

    restore = catch_sigterm()
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_UNUSABLE)
    except click.exceptions.Abort as exc:  # click's form of KeyboardInterrupt (and of EOF at a prompt)
        terminated = isinstance(exc.__cause__, Terminated)
        click.echo("dsforge: terminated" if terminated else "aborted", err=True)
        sys.exit(143 if terminated else 130)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        sys.exit(exit_code(exc))
    except Exception as exc:  # the user gets a message, not a traceback
        click.echo(f"dsforge: internal error: {type(exc).__name__}: "
                   f"{exc} (set DSFORGE_DEBUG=1 for the traceback)",
                   err=True)
        if os.environ.get("DSFORGE_DEBUG"):
            raise
        sys.exit(EXIT_UNUSABLE)
    finally:
        restore()
    sys.exit(EXIT_CLEAN)
