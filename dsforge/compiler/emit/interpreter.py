"""The Python interpreter the emitted launchers run: `launch.python`, else the one that ran `dsforge compile`.

A bare `python` from PATH is whatever the shell finds first, which outside an activated virtual
environment is a Python without torch or dsforge; the interpreter that compiled the job has both
(compile needs dsforge, `dsforge run` checks for torch). It is recorded as an absolute path, not
resolved through symlinks: a venv's ``bin/python`` links to the base interpreter, and only the
link's path makes Python pick up the venv's packages. A Kubernetes pod runs in its own image, where
the compiling machine's path means nothing, so there the default stays `python`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.compiler.spec.schema import JobSpec

#: The interpreter name used where the compiling one cannot be known to exist (a container image).
IMAGE_PYTHON = "python"


def launch_python(spec: JobSpec, compiling: str | None = None) -> str:
    """The interpreter the job's launcher runs: `launch.python` if given, `python` on Kubernetes, else
    ``compiling`` (default: this process's interpreter) as an absolute path."""
    if spec.launch.python is not None:
        return spec.launch.python
    if spec.launch.launcher == "kubernetes":
        return IMAGE_PYTHON
    exe = compiling if compiling is not None else sys.executable
    return os.path.abspath(exe) if exe else IMAGE_PYTHON  # sys.executable is empty in embedded interpreters


def with_interpreter(plan: ResolvedPlan, compiling: str | None = None) -> ResolvedPlan:
    """The plan with `launch.python` filled in (see ``launch_python``), so templates, plugins and plan.json
    all see the one interpreter the job will run."""
    python = launch_python(plan.spec, compiling)
    if python == plan.spec.launch.python:
        return plan
    launch = plan.spec.launch.model_copy(update={"python": python})
    return replace(plan, spec=plan.spec.model_copy(update={"launch": launch}))
