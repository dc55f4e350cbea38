"""The CI scripts parse and pass shellcheck, and .ci/run starts the SLURM cluster before the README's test
command."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / ".ci" / "run", ROOT / "scripts" / "ci" / "start_slurm.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_ci_script_parses_and_passes_shellcheck(script: Path) -> None:
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, parsed.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    checked = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout


def test_ci_starts_slurm_and_requires_it_before_the_tests() -> None:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    start = next(i for i,
                 line in enumerate(lines) if "scripts/ci/start_slurm.sh" in line and not line.startswith("#"))
    require = lines.index("export DSFORGE_REQUIRE_SLURM=1")
    run_tests = next(i for i, line in enumerate(lines) if line.startswith('bash -c "$cmd"'))
    assert start < require < run_tests
    assert any("apt-get install" in line and "slurm-wlm munge" in line for line in lines[:start])
