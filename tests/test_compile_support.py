"""Helpers shared by the compile, ds_config and launcher tests (this module holds no tests itself)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from dsforge.compiler.emit.job_dir import JobFile, render_job
from dsforge.compiler.frontend.extends import deep_merge
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity
from tests.conftest import ROOT

EXAMPLES_DIR = ROOT / "examples"


def example_path(name: str) -> Path:
    """The path of a shipped example job, by stem."""
    return EXAMPLES_DIR / f"{name}.yaml"


def write_variant(tmp_path: Path, base: str, changes: dict[str, Any], file_name: str = "job.yaml") -> Path:
    """Write an example job with ``changes`` deep-merged over it (an `extends:` stays pointing at the
    example's)."""
    raw = yaml.safe_load(example_path(base).read_text(encoding="utf-8"))
    if "extends" in raw:
        raw["extends"] = str((EXAMPLES_DIR / raw["extends"]).resolve())
    path = tmp_path / file_name
    path.write_text(yaml.safe_dump(deep_merge(raw, changes), sort_keys=False), encoding="utf-8")
    return path


def valid_plan(path: Path) -> Plan:
    """Validate a job file and return its plan, failing the test if validation reports an error."""
    result = validate_file(path)
    errors = [f"{d.rule} {d.message}" for d in result.diagnostics if d.severity == Severity.ERROR]
    assert not errors and result.plan is not None, errors
    return result.plan


def example_plan(name: str) -> Plan:
    """The validated plan of a shipped example."""
    return valid_plan(example_path(name))


def variant_plan(tmp_path: Path, base: str, changes: dict[str, Any]) -> Plan:
    """The validated plan of an example with ``changes``."""
    return valid_plan(write_variant(tmp_path, base, changes))


def write_files(directory: Path, files: dict[str, JobFile]) -> Path:
    """Write rendered job files into ``directory`` (as the writer would, modes included)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, f in files.items():
        (directory / name).write_text(f.content, encoding="utf-8")
        os.chmod(directory / name, 0o755 if f.executable else 0o644)
    return directory


def render_to(directory: Path, plan: Plan) -> Path:
    """Render a plan's job directory into ``directory``."""
    return write_files(directory, render_job(plan.resolve()))


def dry_run(script: Path, extra_env: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """Run a launcher with DSFORGE_DRY_RUN=1: the variables it reports and the argv it would exec."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DSFORGE_DRY_RUN": "1", **(extra_env or {})}
    proc = subprocess.run(["bash", str(script)], cwd=script.parent, env=env, check=False, capture_output=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    fields = proc.stdout.decode("utf-8", errors="surrogateescape").split("\0")
    assert fields[-1] == "", "dry-run output must end with a NUL"
    cut = fields.index("--")
    variables = dict(item.split("=", 1) for item in fields[:cut])
    return variables, fields[cut + 1:-1]


def sbatch_directives(text: str) -> dict[str, str]:
    """The `#SBATCH --key=value` directives of a batch script."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            out[key] = value
    return out


def flag(argv: list[str], name: str) -> str:
    """The value of ``--name=value`` in an argument list (fails if absent)."""
    prefix = f"--{name}="
    found = [a[len(prefix):] for a in argv if a.startswith(prefix)]
    assert found, f"{prefix} missing from {argv}"
    return found[0]
