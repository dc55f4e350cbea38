"""The compiler type-checks under `mypy --strict` (with pyproject.toml's [tool.mypy] settings)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_compiler_passes_mypy_strict(tmp_path: Path) -> None:
    # A fresh cache: the result is the one a clean checkout gets (cold: ~4 s of CPU, the runtime and torch not
    # followed), and concurrent runs do not share state.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            "dsforge/compiler",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every module of the compiler was checked (an `exclude` or a skipped package would lower the count).
    found = re.search(r"no issues found in (\d+) source files", proc.stdout)
    assert found is not None, proc.stdout
    assert int(found.group(1)) >= len(list((ROOT / "dsforge" / "compiler").rglob("*.py")))
