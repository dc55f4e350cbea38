"""Shared fixtures: paths of the examples and the bad-job corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture
def write_job(tmp_path: Path):
    """Write a job file into a temporary directory and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write
