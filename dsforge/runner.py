"""`dsforge run`: compile a job into its job directory and start the directory's local launcher (no torch here).

The job directory defaults to ``runs/<job name>``. A directory an earlier `dsforge run` wrote is
reused when the new compile is byte-for-byte the same (so `resume: auto` picks up its checkpoints);
a different compile is refused unless ``fresh`` discards the old run. The launcher runs with this
interpreter's directory first on PATH, so the job's `python` is the one dsforge runs in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

RUNTIME_MODULES = ("torch", "deepspeed", "transformers")
INSTALL_HINT = ("pip install torch==2.13.0 (the CPU build: pip install torch==2.13.0 --index-url "
                "https://download.pytorch.org/whl/cpu), then pip install 'dsforge[runtime]'")


class RunError(Exception):
    """`dsforge run` cannot start the job; ``code`` is the CLI exit code (1 job or run failed, 2 unusable)."""

    def __init__(self, message: str, code: int = 2, report: str = "") -> None:
        super().__init__(message)
        self.code, self.report = code, report


@dataclass
class Prepared:
    """The compiled job directory to launch, and the compile's diagnostics as text."""

    job_dir: Path
    report: str = ""
    reused: bool = False
    notes: list[str] = field(default_factory=list)


def missing_runtime() -> list[str]:
    """The runtime packages that are not importable (checked without importing them)."""
    return [m for m in RUNTIME_MODULES if importlib.util.find_spec(m) is None]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "job"


def _same_compile(old: Path, new: Path) -> bool:
    """True when every file of the new compile exists in ``old`` with the same bytes."""
    names = json.loads((new / "plan.json").read_text(encoding="utf-8"))["files"]
    return all((old / n).is_file() and (old / n).read_bytes() == (new / n).read_bytes() for n in names)


def _is_job_dir(path: Path) -> bool:
    try:
        return json.loads((path / "plan.json").read_text(encoding="utf-8")).get("generator") == "dsforge"
    except (OSError, ValueError, AttributeError):
        return False


def _compile(file: str, scratch: Path) -> tuple[Path, str]:
    """Compile ``file`` into a fresh directory under ``scratch``; (directory, diagnostics text)."""
    from dsforge.compiler.emit.compile import TargetError, compile_file
    from dsforge.formatters import get

    scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dsforge-run-", dir=scratch))
    try:
        result = compile_file(file, tmp)
    except TargetError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(str(exc)) from exc
    report = get("text")(result.diagnostics)
    if result.written is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError("nothing to run: fix the errors above", 2 if result.unusable else 1, report)
    return tmp, report


def prepare(file: str, out: str | None, fresh: bool) -> Prepared:
    """The job directory to launch: a new compile, or the earlier run of the same compile."""
    scratch = Path(out).resolve().parent if out else Path("runs").resolve()
    tmp, report = _compile(file, scratch)
    name = json.loads((tmp / "plan.json").read_text(encoding="utf-8"))["name"]
    target = Path(out).resolve() if out else scratch / _slug(name)
    try:
        if target.exists() and any(target.iterdir()):
            if not _is_job_dir(target):
                raise RunError(f"{target} exists and is not a dsforge job directory; choose another -o")
            if _same_compile(target, tmp) and not fresh:
                return Prepared(target, report, reused=True)
            if not fresh:
                raise RunError(f"{target} holds a run of a different compile of this job; pass --fresh to discard "
                               "it (checkpoints and reports included) or -o to run elsewhere")
            shutil.rmtree(target)
        elif target.exists():
            target.rmdir()
        os.replace(tmp, target)
        return Prepared(target, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def launch(job_dir: Path) -> int:
    """Run the job directory's local launcher; its exit code."""
    doc = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
    launcher, nodes = doc.get("launcher"), doc.get("nodes", 1)
    if launcher not in ("local", "torchrun") or nodes != 1:
        raise RunError(f"this job is started by its `{launcher}` launcher on {nodes} node(s); `dsforge run` starts "
                       f"single-node local jobs only. Run the launcher in {job_dir} as its README says")
    env = dict(os.environ)
    # The launcher calls `python` (launch.python); make it this interpreter, which has dsforge and torch.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.call(["bash", str(job_dir / "launch.sh")], env=env)
