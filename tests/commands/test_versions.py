"""The supported DeepSpeed range: pinned in pyproject, checked by `dsforge run`, the runtime and the
integrations."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.runtime import versions
from dsforge.runtime.versions import (
    INSTALL_HINT,
    SUPPORTED,
    UnsupportedVersionError,
    deepspeed_problem,
    require_deepspeed,
    supported,
)
from tests.conftest import EXAMPLES, ROOT


@pytest.mark.parametrize(("version", "ok"), [
    ("0.19.8", True), ("0.19.9", True), ("0.19.15", True), ("0.19.8+cu124", True), ("0.19.8.post1", True),
    ("v0.19.8", True), ("0.19.8.1", True),
    ("0.19.7", False), ("0.19.8rc1", False), ("0.19.8.dev0", False), ("0.19", False), ("0.18.9", False),
    ("0.20.0", False), ("0.20", False), ("0.20.0.dev0", False), ("0.20.0rc1", False), ("1.0.0", False),
    ("", False), ("unknown", False),
])
def test_supported_range_follows_pep_440(version: str, ok: bool) -> None:
    assert supported(version) is ok


def test_the_message_names_found_supported_and_fix() -> None:
    problem = deepspeed_problem("0.18.2")
    assert problem is not None and "0.18.2" in problem and SUPPORTED in problem and INSTALL_HINT in problem
    assert deepspeed_problem("0.19.8") is None
    missing = deepspeed_problem(None)
    assert missing is not None and "not installed" in missing and INSTALL_HINT in missing


def test_require_reads_the_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    require_deepspeed()  # this environment has the supported 0.19.8
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.20.1")
    with pytest.raises(UnsupportedVersionError, match=r"DeepSpeed 0\.20\.1 is installed.*>=0\.19\.8,<0\.20"):
        require_deepspeed()

    def absent(name: str) -> str:
        raise versions.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", absent)
    assert versions.deepspeed_version() is None
    require_deepspeed(installed_only=True)  # an integration may run without DeepSpeed
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        require_deepspeed()


def test_pyproject_pins_the_checked_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = [d for d in project["optional-dependencies"]["runtime"] if d.startswith("deepspeed")]
    assert pins == [f"deepspeed{SUPPORTED}"]


def test_dsforge_run_refuses_before_compiling(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(versions, "deepspeed_version", lambda: "0.21.0")
    out = tmp_path / "job"
    result = CliRunner().invoke(cli, ["run", str(EXAMPLES[0]), "-o", str(out)])
    assert result.exit_code == 2
    assert "dsforge run: DeepSpeed 0.21.0 is installed" in result.output and INSTALL_HINT in result.output
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_runtime_and_integrations_check_before_deepspeed_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from dsforge.plugins.job import load_job
    from dsforge.runtime import main
    from dsforge.runtime.errors import RuntimeRefusal

    monkeypatch.setattr(versions, "deepspeed_version", lambda: "0.18.0")
    # start_engine checks before it touches the job (None here) or deepspeed.comm
    with pytest.raises(UnsupportedVersionError, match="0.18.0"):
        main.start_engine(None)  # type: ignore[arg-type]
    assert issubclass(UnsupportedVersionError, RuntimeRefusal)  # one line per rank, no traceback
    with pytest.raises(UnsupportedVersionError, match="0.18.0"):
        load_job(EXAMPLES[0])
    monkeypatch.setattr(versions, "deepspeed_version", lambda: None)
    assert load_job(EXAMPLES[0]).plan is not None
