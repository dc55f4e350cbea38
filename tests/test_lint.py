"""`ruff check` finds nothing in the repository (as pyproject.toml's [tool.ruff] configures it)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str | None:
    """The ruff next to this interpreter (the test extra installs it), else the one on PATH."""
    near = Path(sys.executable).with_name("ruff")
    return str(near) if near.exists() else shutil.which("ruff")


def test_ruff_check_is_clean() -> None:
    """Every finding of `ruff check` (as pyproject.toml selects them) fails this test, with ruff's own
    report."""
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    res = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, f"ruff check found problems:\n{res.stdout}{res.stderr}"
