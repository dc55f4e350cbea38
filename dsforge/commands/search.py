"""`dsforge search`: load a job, rank the layouts of its `auto` fields, print, write the chosen job file,
plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsforge.compiler.frontend.parse import LoadedJob, load_job
from dsforge.compiler.search.space import AUTO, AUTO_KEYS, auto_keys, written_layout
from dsforge.compiler.spec.schema import JobSpec
from dsforge.diagnostics import Diagnostic, InputError

#: The degrees and the ZeRO stage (what tests/compiler/search/test_search_exact.py's large examples compare
#: over).
DEGREES = tuple(("parallel", k) for k in ("tp", "pp", "dp", "cp", "ep", "zero"))
#: --compare leaves every field the search can set to it, all but the GPU count (the written layout's own):
#: degrees, ZeRO, sequence parallelism, CP kind, schedule, chunks, micro-batch, recompute; the report's first
#: line names them.
COMPARED = tuple(k for k in AUTO_KEYS if k != ("hardware", "nodes"))


@dataclass
class Outcome:
    """What the command prints (stdout and stderr) and its exit code."""

    text: str = ""
    notes: list[str] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    code: int = 0
    data: dict[str, Any] | None = None


def all_auto(spec: JobSpec, keys: tuple[tuple[str, ...], ...] = COMPARED) -> JobSpec:
    """The job with ``keys`` `auto` (for --compare: every field the search sets but the GPU count)."""
    out = spec
    for path in keys:
        out = _set(out, path, AUTO)
    return out


def _set(section: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return section.model_copy(update={path[0]: value})
    return section.model_copy(update={path[0]: _set(getattr(section, path[0]), path[1:], value)})


def _load(file: str) -> tuple[LoadedJob | None, Outcome]:
    try:
        job, diags = load_job(file)
    except InputError as exc:
        return None, Outcome(diagnostics=exc.diagnostics, code=2)
    if job is None:
        return None, Outcome(diagnostics=diags, code=1)
    return job, Outcome()


def run_search(file: str, fmt: str = "text", top: int | None = None, write: str | None = None,
               plot: str | None = None, compare: bool = False, exhaustive: bool = False,
               selection: Any = None, verify: int | None = None) -> Outcome:
    """The whole command (exit codes: 0 a layout fits, 1 none fits or the job has errors, 2 unusable
    input)."""
    from dsforge.compiler.frontend.project_config import ConfigError
    from dsforge.compiler.rules.selection import Selection
    from dsforge.compiler.search.engine import SpaceTooLarge, search
    from dsforge.compiler.search.resolve import no_fit, rule_filter, unresolvable
    from dsforge.compiler.validate import settings_for
    from dsforge.explain import search_report

    job, out = _load(file)
    if job is None:
        return out
    bad = unresolvable(job)
    if bad:
        return Outcome(diagnostics=bad, code=1)
    spec, written = job.spec, None
    if compare:
        written = written_layout(job.spec)
        if written is None:
            return Outcome(notes=[("--compare ranks the file's own layout: write every layout field as a "
                                  f"value (these are `auto`: "
                                  f"{', '.join('.'.join(k) for k in auto_keys(job.spec))})")], code=2)
        if write:
            return Outcome(notes=["--write replaces `auto` values; with --compare the file has none"], code=2)
        spec = all_auto(job.spec)
    elif not auto_keys(spec):
        return Outcome(notes=[(f"{file}: no field is `auto` (tp, pp, cp, ep, zero, sequence_parallel, ...): "
                              f"nothing to search; --compare ranks this layout among all of them")], code=0)
    try:
        base = settings_for(file).selection
    except ConfigError:  # validate reports the settings file (DSF027); the search filters as without one
        base = Selection()
    chosen = selection.over(base) if selection is not None else base
    try:
        # --plot draws every fitting candidate and --verify runs the last-ranked one: both need all of them
        full = exhaustive or plot is not None or verify is not None
        result = search(job, rule_filter(job, chosen), top, full, written, spec)
    except SpaceTooLarge as exc:
        return Outcome(notes=[f"the search space holds {exc}: fix some `auto` fields, or set search.max_tp"],
                       code=1)
    out = Outcome(data=search_report.to_json(result))
    if fmt == "text":
        out.text = search_report.render(result, job.spec.name)
    if result.winner is None:
        out.diagnostics = [no_fit(job, result)] if fmt == "text" else []
        out.code = 1
        return out
    if write:
        from dsforge.compiler.search.write import WriteError, write_job

        try:
            write_job(job, result.winner.layout, write)
            out.notes.append(f"wrote {write}: {job.source.file} with the winner's values in place of `auto`")
        except (WriteError, OSError) as exc:
            out.notes.append(f"cannot --write {write}: {exc}")
            out.code = 2
    if verify:
        from dsforge.commands import search_verify
        from dsforge.commands.run import INSTALL_HINT, missing_runtime

        if missing_runtime():
            out.notes.append(f"--verify runs `dsforge run`, which needs the runtime: {INSTALL_HINT}")
            out.code = 2
            return out
        rows = search_verify.verify(job, result, verify)
        out.text += "\n" + search_verify.render(rows)
        if out.data is not None:
            out.data["verify"] = [{"rank": v.rank, "layout": v.candidate.layout.as_dict(),
                                   "predicted_step_s": v.candidate.step.step_s, "measured_step_s": v.step_s,
                                   "predicted_peak_bytes": v.candidate.memory.peak.device_bytes,
                                   "measured_peak_bytes": v.peak_bytes, "error": v.error} for v in rows]
    if plot:
        try:
            paths = search_report.write_plot(result, plot)
            out.notes.append(f"wrote {', '.join(str(p) for p in paths)}")
        except ImportError:
            out.notes.append("--plot needs matplotlib: pip install 'dsforge[plots]'")
            out.code = 2
    return out



def command(file: str, fmt: str, top: int | None, write: str | None, plot_dir: str | None, compare: bool,
            exhaustive: bool, verify: int | None, selection: Any) -> None:
    """`dsforge search`: run the search, print its report and notes; exits with the command's code."""
    import sys

    import click

    from dsforge.formatters import get

    out = run_search(file, fmt, top, write, plot_dir, compare, exhaustive, selection, verify)
    if out.diagnostics:
        click.echo(get("text")(out.diagnostics), nl=False, err=fmt == "json")
    if fmt == "json" and out.data is not None:
        from dsforge.compiler.strict_json import dumps

        click.echo(dumps(out.data, indent=2))
    elif out.text:
        click.echo(out.text, nl=False)
    for note in out.notes:
        click.echo(f"dsforge search: {note}", err=True)
    sys.exit(out.code)
