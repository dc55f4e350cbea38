"""Render every file of a job directory from a plan: a pure function from plan to {name: file}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsforge.compiler.emit.ds_config import EmitError, build_ds_config
from dsforge.compiler.emit.interpreter import with_interpreter
from dsforge.compiler.emit.launchers import CORE_FILES, launch_context, launch_files
from dsforge.compiler.emit.plan_doc import plan_document
from dsforge.compiler.emit.render import render
from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.version import __version__

#: Kubernetes refuses ConfigMaps over 1 MiB (etcd's object limit).
CONFIGMAP_LIMIT_BYTES = 1024 * 1024


@dataclass(frozen=True)
class JobFile:
    """One file of the job directory: its text and whether it is executable."""

    content: str
    executable: bool = False


def _configmap(files: dict[str, JobFile]) -> list[tuple[str, str]]:
    entries = [(name, files[name].content) for name in ("ds_config.json", "plan.json", "train.py")]
    size = sum(len(content.encode("utf-8")) for _, content in entries)
    if size > CONFIGMAP_LIMIT_BYTES:
        raise EmitError(f"the job's files take {size:,} bytes but a Kubernetes ConfigMap holds at most "
                        f"{CONFIGMAP_LIMIT_BYTES:,}; use the slurm or torchrun launcher, or ship the job "
                        "directory inside the image")
    return entries


def render_job(plan: ResolvedPlan, summary: dict[str, Any] | None = None,
               rewrite: dict[str, Any] | None = None, python: str | None = None) -> dict[str, JobFile]:
    """Every file of the job directory for a validated plan; ``summary`` and ``rewrite`` go into plan.json.

    Raises EmitError if the plan cannot be emitted. ``python``: the interpreter that compiles (default:
    this one), which the launcher runs unless `launch.python` names another.
    """
    plan = with_interpreter(plan, python)
    launch = plan.spec.launch
    if launch.launcher == "deepspeed" and plan.nodes > 1 and len(launch.hosts) != plan.nodes:
        raise EmitError(f"the hostfile needs {plan.nodes} host names "
                        f"in launch.hosts, got {len(launch.hosts)}")
    extra = launch_files(plan)
    names = [*CORE_FILES, *(f.name for f in extra)]
    doc = plan_document(plan, names, summary, rewrite)
    files = {
        "ds_config.json": JobFile(render("ds_config.json.j2", config=build_ds_config(plan))),
        "plan.json": JobFile(render("plan.json.j2", plan=doc)),
        "train.py": JobFile(render("train.py.j2", version=__version__), executable=True),
    }
    ctx = {**launch_context(plan), "version": __version__}
    if launch.launcher == "kubernetes":
        ctx["configmap"] = _configmap(files)
    for f in extra:  # a plugin's launch target brings its files rendered (content), built-ins a template
        files[f.name] = JobFile(f.content if f.content is not None else render(f.template, **ctx),
                                f.executable)
    files["README.md"] = JobFile(render(
        "README.md.j2", **ctx, launcher=launch.launcher, degrees=doc["degrees"], zero=doc["zero"],
        stage_layers=doc["stage_layers"], ds=doc["deepspeed"],
        launch_files=[(f.name, f.purpose) for f in extra]))
    return {name: files[name] for name in sorted(files)}
