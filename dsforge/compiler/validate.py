"""`validate`: load, parse, plan and check one job file, collecting every diagnostic.

Which findings are reported follows the project's settings (`dsforge.toml` / `[tool.dsforge]`, found
from the job file's directory), the caller's selection and the file's inline `# dsforge: ignore[...]`
comments (dsforge/compiler/rules/selection.py); explain, compile and run validate through here, so they all
decide on the same findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dsforge.compiler.frontend.parse import LoadedJob, load_job
from dsforge.compiler.frontend.project_config import ConfigError, ProjectConfig, find_config
from dsforge.compiler.frontend.source import is_stdin
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.rules.registry import Context, Rule, run_rules
from dsforge.compiler.rules.selection import Selection, apply
from dsforge.diagnostics import Diagnostic, InputError, Location, Severity, has_errors

if TYPE_CHECKING:
    from dsforge.compiler.search.engine import SearchResult


@dataclass
class Result:
    """The outcome for one file: its diagnostics, the job and plan when it got that far, and its settings."""

    file: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    job: LoadedJob | None = None
    plan: Plan | None = None
    unusable: bool = False
    strict: bool = False  # the project's settings ask warnings to fail
    silenced: int = 0  # findings the selection or inline comments silenced
    selection: Selection = field(default_factory=Selection)  # what was chosen: the settings' and the caller's
    search: SearchResult | None = None  # the layout search that resolved the job's `auto` fields


def check(job: LoadedJob, rules: list[Rule] | None = None) -> tuple[Plan, list[Diagnostic]]:
    """Plan a loaded job and run the rules over it (every finding, before any selection)."""
    plan = build_plan(job.spec)
    return plan, run_rules(Context(job.spec, plan, job.source, job.raw), rules)


def settings_for(path: str | Path) -> ProjectConfig:
    """The project settings that apply to a job file (raises ConfigError for a settings file it cannot
    use)."""
    return find_config(Path.cwd() if is_stdin(path) else Path(path).parent)


def validate_file(path: str | Path, rules: list[Rule] | None = None, selection: Selection | None = None,
                  config: ProjectConfig | None = None) -> Result:
    """Validate one job file; never raises for bad input (unusable files come back flagged).

    ``selection`` (command-line `--select`/`--ignore`) is merged over the project's settings, which are
    looked up unless ``config`` is given.
    """
    result = Result(str(path))
    try:
        settings = config if config is not None else settings_for(path)
    except ConfigError as exc:
        result.diagnostics = [Diagnostic("DSF027", Severity.ERROR, str(exc), Location(str(path)),
                                         "fix or remove the settings file (README, CI section)")]
        result.unusable = True
        return result
    result.strict = settings.strict
    chosen = settings.selection if selection is None else selection.over(settings.selection)
    result.selection = chosen
    try:
        job, diags = load_job(path)
    except InputError as exc:
        result.diagnostics, result.unusable = exc.diagnostics, True
        return result
    if job is None:
        result.diagnostics = diags
        return result
    result.job = job
    chose: list[Diagnostic] = []
    from dsforge.compiler.search.space import auto_keys

    if auto_keys(job.spec):  # the same search as `dsforge search` fills them, or says why it cannot
        from dsforge.compiler.search.resolve import record, resolve

        res = resolve(job, chosen)
        result.search, chose = res.result, res.diagnostics
        if res.job is None:
            outcome = apply(chose, chosen, job.source.ignores)
            result.diagnostics, result.silenced = outcome.diagnostics, outcome.silenced
            return result
        job = result.job = res.job
    result.plan, found = check(job, rules)
    if result.search is not None and result.search.ranked:
        result.plan = replace(result.plan, search=record(result.search))
    outcome = apply(found + chose, chosen, job.source.ignores)
    result.diagnostics, result.silenced = outcome.diagnostics, outcome.silenced
    return result


class InvalidJob(Exception):
    """A job that cannot be used (unusable input, or errors); ``result`` holds every diagnostic to show."""

    def __init__(self, result: Result) -> None:
        super().__init__(f"{result.file}: the job has errors")
        self.result = result


@dataclass(frozen=True)
class ValidJob:
    """A job `require_valid` accepted: its result (diagnostics: warnings at most), its loaded job and its
    plan."""

    result: Result
    job: LoadedJob
    plan: Plan

    @property
    def diagnostics(self) -> list[Diagnostic]:
        """The job's reported findings (no errors)."""
        return self.result.diagnostics


def require_valid(path: str | Path, selection: Selection | None = None) -> ValidJob:
    """Validate a job file that is about to be used (explain, the runtime, the trainer plugins); InvalidJob
    when it is unusable or has errors, so that every caller refuses exactly the same jobs."""
    result = validate_file(path, selection=selection)
    if result.unusable or result.job is None or result.plan is None or has_errors(result.diagnostics):
        raise InvalidJob(result)
    return ValidJob(result, result.job, result.plan)
