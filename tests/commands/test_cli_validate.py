"""`dsforge validate`, `schema` and `presets` from the command line, and the CI wrappers around them
(the pre-commit hook and the composite GitHub Action)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dsforge import cli as cli_module
from dsforge.cli import cli
from tests.conftest import EXAMPLES, ROOT

BAD = ROOT / "tests" / "fixtures" / "bad"
TP_KV = str(BAD / "dsf104-tp-kv-heads.yaml")  # one error
WARN = str(BAD / "dsf204-bubble.yaml")  # one warning
UNUSABLE = str(BAD / "dsf005-duplicate-key.yaml")


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_examples_exit_clean() -> None:
    result = _run("validate", "--strict", *map(str, EXAMPLES))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "0 error(s), 0 warning(s), 0 note(s)"


def test_error_exits_1_with_location_message_and_fix() -> None:
    result = _run("validate", TP_KV)
    assert result.exit_code == 1
    first, fix, summary = result.output.splitlines()
    assert re.fullmatch(r".*dsf104-tp-kv-heads\.yaml:10:7: error\[DSF104\] "
                        r"tp=4 does not divide kv_heads=2: .*", first)
    assert fix.startswith("  fix: use tp in {1, 2}") and summary.startswith("1 error(s)")


def test_warnings_fail_only_with_strict() -> None:
    assert _run("validate", WARN).exit_code == 0
    assert _run("validate", "--strict", WARN).exit_code == 1


def test_unusable_input_exits_2_even_next_to_other_findings() -> None:
    result = _run("validate", TP_KV, UNUSABLE)
    assert result.exit_code == 2 and "DSF104" in result.output and "DSF005" in result.output


def test_missing_file_and_directory_are_unusable(tmp_path: Path) -> None:
    result = _run("validate", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "DSF001" in result.output and "does not exist" in result.output
    assert _run("validate", str(tmp_path)).exit_code == 2  # click refuses a directory


def test_no_files_is_a_usage_error() -> None:
    assert _run("validate").exit_code == 2


@pytest.mark.parametrize("fmt", ["text", "json", "github", "sarif"])
def test_every_format_writes_to_output_file(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"report.{fmt}"
    result = _run("validate", "--format", fmt, "-o", str(out), TP_KV)
    assert result.exit_code == 1 and result.output == ""
    text = out.read_text(encoding="utf-8")
    assert "DSF104" in text
    if fmt in ("json", "sarif"):
        json.loads(text)


def test_unwritable_output_is_a_clear_error(tmp_path: Path) -> None:
    result = _run("validate", "-o", str(tmp_path / "no-such-dir" / "r.txt"), TP_KV)
    assert (
        result.exit_code == 2
        and "cannot write the report" in result.output
        and "Traceback" not in result.output
    )
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_schema_and_presets_commands() -> None:
    schema = json.loads(_run("schema").output)
    assert schema["title"] == "dsforge job file" and "parallel" in schema["properties"]
    listing = _run("presets").output
    assert "dgx-h100" in listing and "llama3-8b" in listing
    data = json.loads(_run("presets", "--kind", "models", "--format", "json").output)
    assert set(data) == {"models"} and data["models"]["tiny-llama"]["spec"]["layers"] == 4


def test_main_turns_an_unexpected_exception_into_one_line(monkeypatch, capsys) -> None:
    def explode(*args, **kwargs):
        raise RuntimeError("kaput")

    monkeypatch.setattr("dsforge.compiler.validate.validate_file", explode)
    monkeypatch.setattr(sys, "argv", ["dsforge", "validate", TP_KV])
    monkeypatch.delenv("DSFORGE_DEBUG", raising=False)
    monkeypatch.delenv("PYDANTIC_DISABLE_PLUGINS", raising=False)  # main() sets it; undone after the test
    with pytest.raises(SystemExit) as info:
        cli_module.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: kaput" in err and "Traceback" not in err


# ---- the pre-commit hook ----

def test_pre_commit_hook_runs_dsforge_validate_on_job_files() -> None:
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    (hook,) = [h for h in hooks if h["id"] == "dsforge-validate"]
    assert hook["language"] == "python" and hook["entry"].split() == ["dsforge", "validate"]
    scripts = re.search(r"\[project\.scripts\]\s*\n(.*?)\n", (ROOT / "pyproject.toml").read_text()).group(1)
    # the entry point the hook calls exists
    assert scripts.replace(" ", "") == 'dsforge="dsforge.__main__:main"'
    files = re.compile(hook["files"])
    for name in ("train.dsforge.yaml", "a/b/llama.dsforge.yml", "jobs/llama.yaml", "infra/job/x.yml"):
        assert files.search(name), name
    for name in ("docker-compose.yaml", "jobs/sub/deeper.yaml", "dsforge.yaml.bak"):
        assert not files.search(name), name


# ---- the GitHub Action ----

ACTION = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))


def _step(step_id_or_name: str) -> dict:
    return next(s for s in ACTION["runs"]["steps"] if step_id_or_name in (s.get("id"), s.get("name")))


def test_action_is_composite_with_the_documented_inputs() -> None:
    assert ACTION["runs"]["using"] == "composite"
    inputs = ACTION["inputs"]
    assert {"files", "format", "strict"} <= set(inputs)
    assert inputs["format"]["default"] == "github" and inputs["strict"]["default"] == "false"
    install = _step("Install dsforge (no torch, no DeepSpeed)")["run"]
    assert (
        "pip install" in install
        and "torch" not in install.replace("no torch", "")
        and "[runtime]" not in install
    )
    assert "${{" not in _step("validate")["run"]  # inputs arrive as environment variables only


def _run_action_script(tmp_path: Path, **env: str) -> tuple[int, str, dict[str, str]]:
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    script = tmp_path / "validate.sh"
    script.write_text(_step("validate")["run"], encoding="utf-8")
    outputs = tmp_path / "github_output"
    outputs.write_text("")
    bin_dir = Path(sys.executable).parent  # the dsforge console script of this environment
    full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "GITHUB_OUTPUT": str(outputs),
                **env}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=60, check=False)
    pairs = dict(line.split("=", 1) for line in outputs.read_text().splitlines() if "=" in line)
    return proc.returncode, proc.stdout + proc.stderr, pairs


def test_action_script_annotates_and_reports_the_exit_code(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    shutil.copy(TP_KV, tmp_path / "jobs" / "bad.dsforge.yaml")
    shutil.copy(EXAMPLES[0], tmp_path / "jobs" / "ok.dsforge.yaml")
    code, out, outputs = _run_action_script(tmp_path, DSFORGE_FILES="**/*.dsforge.yaml",
                                            DSFORGE_FORMAT="github", DSFORGE_STRICT="false",
                                            DSFORGE_SARIF="dsforge.sarif")
    assert code == 0 and outputs["exit-code"] == "1"  # the last step of the action fails the job
    assert "::error file=jobs/bad.dsforge.yaml,line=10,col=7,title=DSF104::" in out
    assert "checked 2 file(s)" in out


def test_action_script_writes_sarif(tmp_path: Path) -> None:
    shutil.copy(WARN, tmp_path / "a.dsforge.yaml")
    code, _, outputs = _run_action_script(tmp_path, DSFORGE_FILES="*.dsforge.yaml", DSFORGE_FORMAT="sarif",
                                          DSFORGE_STRICT="true", DSFORGE_SARIF="out.sarif")
    assert code == 0 and outputs == {"sarif-file": "out.sarif", "exit-code": "1"}  # strict: the warning fails
    sarif = json.loads((tmp_path / "out.sarif").read_text())
    assert sarif["runs"][0]["results"][0]["ruleId"] == "DSF204"


def test_action_script_fails_when_nothing_matches(tmp_path: Path) -> None:
    code, out, outputs = _run_action_script(tmp_path, DSFORGE_FILES="jobs/*.yaml", DSFORGE_FORMAT="github",
                                            DSFORGE_STRICT="false", DSFORGE_SARIF="x")
    assert code == 0 and outputs["exit-code"] == "2" and "no job files match" in out


def test_action_scripts_pass_shellcheck(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    for step in ACTION["runs"]["steps"]:
        if "run" in step:
            script = tmp_path / "step.sh"
            script.write_text("#!/usr/bin/env bash\n" + step["run"], encoding="utf-8")
            proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, check=False)
            assert proc.returncode == 0, f"{step['name']}: {proc.stdout}"
