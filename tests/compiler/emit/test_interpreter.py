"""The emitted launchers run the interpreter that compiled the job (recorded in plan.json), not `python` from
PATH.

`launch.python` still names another one (nodes with their own Python); a Kubernetes pod runs its image's
`python`. Each launcher is checked by running its script in dry-run mode with a PATH that has no
virtual environment on it, so what it would exec is read back, not assumed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.commands.compile import compile_file
from dsforge.compiler.emit.interpreter import IMAGE_PYTHON, launch_python
from dsforge.compiler.emit.job_dir import render_job
from dsforge.compiler.plan.plan import Plan
from tests.test_compile_support import dry_run, variant_plan, write_files

#: The launcher script of every launcher that writes one, and its extra launch keys.
SCRIPTS = {"local": "launch.sh", "torchrun": "launch.sh", "deepspeed": "launch.sh", "slurm": "slurm.sbatch",
           "accelerate": "launch.sh"}
BARE_PATH = {"PATH": "/usr/bin:/bin"}  # no virtual environment, no pyenv shims
COMPILING = "/opt/some venv/bin/python3.11"  # a space, as in a home directory on macOS


def plan_for(tmp_path: Path, launcher: str, **launch: Any) -> Plan:
    extra = {"image": "img:1"} if launcher == "kubernetes" else {}
    return variant_plan(tmp_path, "tiny-tp2-dp2", {"launch": {"launcher": launcher, **extra, **launch}})


def exec_argv(directory: Path, launcher: str) -> list[str]:
    """The command the launcher script would exec, with only /usr/bin:/bin on PATH."""
    _, argv = dry_run(directory / SCRIPTS[launcher], {**BARE_PATH, "NODE_RANK": "0"})
    return argv


def pod_python(directory: Path) -> str:
    _, job = yaml.safe_load_all((directory / "pytorchjob.yaml").read_text(encoding="utf-8"))
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return str(container["command"][3]).replace("$$", "$")


def recorded(directory: Path) -> str:
    return str(json.loads((directory / "plan.json").read_text(encoding="utf-8"))["job"]["launch"]["python"])


@pytest.mark.parametrize("launcher", sorted(SCRIPTS))
def test_every_launcher_runs_the_compiling_interpreter_by_default(tmp_path: Path, launcher: str) -> None:
    directory = write_files(tmp_path / "job",
                            render_job(plan_for(tmp_path, launcher).resolve(), python=COMPILING))
    argv = exec_argv(directory, launcher)
    assert COMPILING in argv and argv[argv.index(COMPILING) + 1] == "-m"
    assert "python" not in argv  # nothing is left to PATH
    assert recorded(directory) == COMPILING


@pytest.mark.parametrize("launcher", [*sorted(SCRIPTS), "kubernetes"])
def test_launch_python_overrides_the_default(tmp_path: Path, launcher: str) -> None:
    nodes_python = "/shared/env/bin/python3"
    plan = plan_for(tmp_path, launcher, python=nodes_python)
    directory = write_files(tmp_path / "job", render_job(plan.resolve(), python=COMPILING))
    if launcher == "kubernetes":
        assert pod_python(directory) == nodes_python
    else:
        argv = exec_argv(directory, launcher)
        assert nodes_python in argv and COMPILING not in argv
    assert recorded(directory) == nodes_python


def test_kubernetes_pods_run_the_image_python_unless_told(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, "kubernetes")
    directory = write_files(tmp_path / "job", render_job(plan.resolve(), python=COMPILING))
    assert pod_python(directory) == IMAGE_PYTHON == recorded(directory)
    assert COMPILING not in (directory / "pytorchjob.yaml").read_text(encoding="utf-8")


def test_compile_records_this_interpreter_and_its_script_needs_no_path(tmp_path: Path) -> None:
    from tests.test_compile_support import write_variant

    result = compile_file(write_variant(tmp_path, "tiny-tp2-dp2", {}), tmp_path / "job", rewrite=False)
    assert result.written is not None, [d.message for d in result.diagnostics]
    # not resolved through the venv's symlink
    assert recorded(result.written) == os.path.abspath(sys.executable)
    argv = exec_argv(result.written, "local")
    assert argv[0] == os.path.abspath(sys.executable) and os.access(argv[0], os.X_OK)


def test_an_empty_interpreter_name_falls_back_to_python(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, "local")
    assert launch_python(plan.spec, "") == IMAGE_PYTHON  # sys.executable is "" in embedded interpreters
    assert launch_python(plan.spec, "bin/python") == os.path.abspath("bin/python")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), min_size=1,
                    max_size=40))
def test_any_interpreter_path_arrives_literally(tmp_path: Path, path: str) -> None:
    compiling = "/" + path  # absolute, so abspath leaves it alone unless it has .. or // segments
    expected = os.path.abspath(compiling)
    directory = write_files(tmp_path / "job",
                            render_job(plan_for(tmp_path, "local").resolve(), python=compiling))
    assert exec_argv(directory, "local")[0] == expected
    assert recorded(directory) == expected
