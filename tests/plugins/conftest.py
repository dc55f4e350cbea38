"""The fixture plugin "installed" without touching the venv, and helpers to run dsforge in a subprocess.

The package tests/fixtures/plugin_pkg is copied into a temporary site directory next to a
``dsforge_fixture_plugin-0.1.0.dist-info`` whose entry_points.txt is generated from the package's
own pyproject.toml: exactly what `pip install` writes, found the same way (a folder on sys.path).
Subprocesses get the directory on PYTHONPATH, so the plugin's registrations never leak into this
test process or into the developer's environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_PKG = ROOT / "tests" / "fixtures" / "plugin_pkg"
DSFORGE = [sys.executable, "-m", "dsforge"]


def install_fixture_plugin(site: Path) -> Path:
    """Write the fixture plugin and its dist-info into ``site`` (a sys.path folder); returns ``site``."""
    meta = tomllib.loads((PLUGIN_PKG / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    shutil.copytree(PLUGIN_PKG / "dsforge_fixture_plugin", site / "dsforge_fixture_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: "
                                   f"{meta['name']}\nVersion: {meta['version']}\n\n",
                                   encoding="utf-8")
    groups = [f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
              for group, entries in meta["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(groups), encoding="utf-8")
    return site


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site folder holding the fixture plugin as if pip had installed it."""
    return install_fixture_plugin(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="session")
def plugin_env(plugin_site: Path) -> dict[str, str]:
    """The environment of a subprocess that has the fixture plugin installed."""
    path = os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def run(args: list[str], env: dict[str, str], cwd: Path | None = None,
        timeout: int = 120) -> subprocess.CompletedProcess:
    """Run a command; its output as text."""
    return subprocess.run(args, check=False, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    """Fail when the process printed a Python traceback."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
