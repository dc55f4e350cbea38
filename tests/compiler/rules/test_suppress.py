"""Choosing findings: --select/--ignore, inline `# dsforge: ignore[...]`, [tool.dsforge] / dsforge.toml,
--format gcc."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.compiler.frontend.inline_ignores import scan_comments
from dsforge.compiler.rules.selection import Selection, parse_ids
from dsforge.compiler.validate import validate_file

#: A tiny job with one warning (DSF204: a 33 % pipeline bubble) on line 9 and one note-free rest.
BUBBLE = """version: 1
model:
  preset: tiny-llama
hardware:
  preset: cpu-local
  gpus_per_node: 4
parallel:
  tp: 1
  pp: 2{pp_comment}
  zero: 1
training:
  global_batch: 4
  micro_batch: 1
  precision: fp32
"""
#: The same model on 16 GB of a 1 GB machine: DSF301, an estimate error the user may silence.
TOO_BIG = """version: 1
model: {preset: tiny-llama, layers: 64, hidden: 2048, heads: 16, kv_heads: 16, ffn_hidden: 8192, vocab: 32000}
hardware: {preset: cpu-local, gpus_per_node: 2, accelerator: {name: cpu, memory_gb: 1}}
parallel: {tp: 1, zero: 1}
training: {global_batch: 2, micro_batch: 1, precision: fp32}
"""


def _rules(path: Path, **kw) -> list[str]:
    return [d.rule for d in validate_file(path, **kw).diagnostics]


def _run(*args: str, cwd: Path | None = None):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_inline_comment_on_the_line_or_the_line_above(write_job) -> None:
    assert _rules(write_job(BUBBLE.format(pp_comment=""))) == ["DSF204"]
    assert _rules(write_job(BUBBLE.format(pp_comment="  # dsforge: ignore[DSF204]"))) == []
    assert _rules(write_job(BUBBLE.format(pp_comment="  # dsforge: ignore[DSF2]"))) == []  # a prefix
    above = BUBBLE.format(pp_comment="").replace("  pp: 2", "  # dsforge: ignore[DSF204]\n  pp: 2")
    assert _rules(write_job(above)) == []
    # a comment on another line, or naming another rule, silences nothing
    elsewhere = BUBBLE.format(pp_comment="").replace("  zero: 1", "  zero: 1  # dsforge: ignore[DSF204]")
    assert _rules(write_job(elsewhere)) == ["DSF204"]
    assert _rules(write_job(BUBBLE.format(pp_comment="  # dsforge: ignore[DSF301]"))) == ["DSF204"]


def test_inline_comment_inside_a_quoted_string_is_not_a_comment() -> None:
    assert scan_comments('name: "a # dsforge: ignore[DSF204]"\n', "j.yaml") == []
    assert scan_comments("name: 'x' # dsforge: ignore[DSF204]\n", "j.yaml")[0].ids == ("DSF204",)
    assert scan_comments("name: a#dsforge: ignore[DSF204]\n", "j.yaml") == []  # YAML needs a blank before #
    (alone,) = scan_comments("# dsforge: ignore[dsf204, DSF3]\nparallel: {}\n", "j.yaml")
    assert alone.ids == ("DSF204", "DSF3") and alone.target_line == 2


def test_unknown_or_missing_ids_in_a_comment_are_reported(write_job) -> None:
    bad = write_job(BUBBLE.format(pp_comment="  # dsforge: ignore[DSF2O4]"))
    assert _rules(bad) == ["DSF204", "DSF026"]
    bare = write_job(BUBBLE.format(pp_comment="  # dsforge: ignore"))
    found = validate_file(bare).diagnostics
    assert [d.rule for d in found] == ["DSF204", "DSF026"] and "names no rule id" in found[1].message


def test_comments_in_an_extended_base_apply_to_its_lines(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(BUBBLE.format(pp_comment="  # dsforge: ignore[DSF204]"),
                                        encoding="utf-8")
    child = tmp_path / "job.yaml"
    child.write_text("extends: base.yaml\nname: child\n", encoding="utf-8")
    assert _rules(child) == []


def test_errors_that_stop_a_job_cannot_be_silenced(write_job) -> None:
    job = write_job(BUBBLE.format(pp_comment="").replace("tp: 1", "tp: 3  # dsforge: ignore[DSF103]"))
    result = validate_file(job)
    assert "DSF103" in [d.rule for d in result.diagnostics]
    refusal = [d for d in result.diagnostics if d.rule == "DSF026"]
    assert refusal and "DSF103 cannot be silenced" in refusal[0].message
    # loader and schema findings are always reported, whatever the selection
    schema = write_job("version: 1\nmodel: {preset: tiny-llama}\nhardware: {preset: cpu-local}\ntypo: 1\n")
    assert _rules(schema, selection=Selection.of(["DSF3"], ["DSF0"])) == ["DSF020"]


def test_estimate_errors_can_be_silenced_and_compile_then_writes(write_job, tmp_path: Path) -> None:
    job = write_job(TOO_BIG)
    assert _rules(job) == ["DSF301"]
    assert _rules(job, selection=Selection.of((), ["DSF301"])) == []
    refused = _run("compile", "--no-rewrite", str(job), "-o", str(tmp_path / "a"))
    assert refused.exit_code == 1 and not (tmp_path / "a").exists()
    written = _run("compile", "--no-rewrite", "--ignore", "DSF301", str(job), "-o", str(tmp_path / "b"))
    assert written.exit_code == 0 and (tmp_path / "b" / "plan.json").is_file()


def test_select_and_ignore_on_the_command_line(write_job) -> None:
    job = write_job(BUBBLE.format(pp_comment=""))
    assert _run("validate", "--strict", str(job)).exit_code == 1
    assert _run("validate", "--strict", "--ignore", "DSF204", str(job)).exit_code == 0
    assert _run("validate", "--strict", "--select", "DSF1,DSF3", str(job)).exit_code == 0
    assert _run("validate", "--strict", "--select", "DSF2", "--ignore", "DSF20", str(job)).exit_code == 0
    unknown = _run("validate", "--ignore", "DSF999", str(job))  # a typo in a CI flag fails loudly
    assert unknown.exit_code == 2 and "DSF999 matches no rule" in unknown.output
    assert "matches no rule" in _run("validate", "--select", "pp", str(job)).output
    bad = _run("validate", "--select", "DSF1234", str(job))
    assert bad.exit_code == 2 and "'DSF1234' is not a rule id or prefix" in bad.output


def test_explain_follows_the_selection(write_job) -> None:
    job = write_job(TOO_BIG)
    assert _run("explain", str(job)).exit_code == 1
    assert _run("explain", "--ignore", "DSF301", str(job)).exit_code == 0


@pytest.mark.parametrize("name", ["pyproject.toml", "dsforge.toml"])
def test_project_settings_apply_to_jobs_below_them(tmp_path: Path, name: str) -> None:
    table = "[tool.dsforge]\n" if name == "pyproject.toml" else ""
    (tmp_path / name).write_text(f'{table}ignore = ["DSF204"]\nstrict = true\n', encoding="utf-8")
    sub = tmp_path / "jobs" / "team"
    sub.mkdir(parents=True)
    job = sub / "job.yaml"
    job.write_text(BUBBLE.format(pp_comment=""), encoding="utf-8")
    result = validate_file(job)
    assert result.diagnostics == [] and result.strict and result.silenced == 1
    # strict from the settings makes a warning fail the command
    job.write_text(
        BUBBLE.format(pp_comment="").replace(
            "global_batch: 4", "global_batch: 4\n  steps: 2\n  scheduler: {name: cosine, warmup_steps: 5}"
        ),
        encoding="utf-8",
    )
    assert _run("validate", str(job)).exit_code == 1


def test_the_nearest_settings_file_wins_and_dsforge_toml_beats_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.dsforge]\nignore = ["DSF204"]\n', encoding="utf-8")
    sub = tmp_path / "sub"
    sub.mkdir()
    # no dsforge table: skipped
    (sub / "pyproject.toml").write_text("[project]\nname = 'x'\n", encoding="utf-8")
    job = sub / "job.yaml"
    job.write_text(BUBBLE.format(pp_comment=""), encoding="utf-8")
    assert _rules(job) == []
    (sub / "dsforge.toml").write_text('select = ["DSF1"]\n', encoding="utf-8")
    (sub / "pyproject.toml").write_text('[tool.dsforge]\nselect = ["DSF2"]\n', encoding="utf-8")
    assert _rules(job) == []  # dsforge.toml selects DSF1 only; the DSF2 warning is not reported
    assert _rules(job, selection=Selection.of(["DSF2"], ())) == ["DSF204"]  # the command line replaces select


@pytest.mark.parametrize("text, message", [
    ("[tool.dsforge]\nignroe = []\n", "unknown key(s) 'ignroe'"),
    ("[tool.dsforge]\nignore = 'DSF204'\n", "ignore must be a list of rule ids"),
    ("[tool.dsforge]\nignore = ['not an id']\n", "NOT matches no rule"),
    ("[tool.dsforge]\nselect = ['DSF2O4']\n", "'DSF2O4' is not a rule id"),
    ("[tool.dsforge]\nstrict = 'yes'\n", "strict must be true or false"),
    ("[tool.dsforge\n", "not valid TOML"),
    ("[tool]\ndsforge = 3\n", "must be a table"),
])
def test_a_settings_file_that_cannot_be_used_is_dsf027(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "pyproject.toml").write_text(text, encoding="utf-8")
    job = tmp_path / "job.yaml"
    job.write_text(BUBBLE.format(pp_comment=""), encoding="utf-8")
    result = validate_file(job)
    assert result.unusable and [d.rule for d in result.diagnostics] == ["DSF027"]
    assert (
        message in result.diagnostics[0].message
        and str(tmp_path / "pyproject.toml") in result.diagnostics[0].message
    )
    cli_result = _run("validate", "--format", "json", str(job))
    assert cli_result.exit_code == 2 and json.loads(cli_result.output)["diagnostics"][0]["rule"] == "DSF027"


def test_gcc_format_matches_the_editors_problem_matcher(write_job) -> None:
    job = write_job(BUBBLE.format(pp_comment="").replace("tp: 1", "tp: 3"))
    out = _run("validate", "--format", "gcc", str(job)).output.splitlines()
    # VS Code's $gcc matcher
    gcc = re.compile(r"^(.*?):(\d+):(\d*):?\s+(?:fatal\s+)?(warning|error):\s+(.*)$")
    findings = [line for line in out if not line.startswith(" ")]
    assert findings and all(gcc.match(line) for line in findings if ": note: " not in line)
    assert any(line.endswith("[DSF103]") and ":9:" not in line for line in findings)


@given(st.lists(st.sampled_from(["DSF", "DSF1", "DSF20", "DSF204", "DSF301", "DSF0"]), max_size=4),
       st.lists(st.sampled_from(["DSF", "DSF2", "DSF204", "DSF3", "DSF0"]), max_size=4),
       st.sampled_from(["DSF001", "DSF020", "DSF101", "DSF204", "DSF301", "DSF609"]))
def test_selection_is_prefix_select_minus_prefix_ignore(select: list[str], ignore: list[str],
                                                        rule_id: str) -> None:
    wanted = Selection.of(select, ignore).wants(rule_id)
    if rule_id.startswith("DSF0"):
        assert wanted
    else:
        chosen = not select or any(rule_id.startswith(p) for p in select)
        assert wanted == (chosen and not any(rule_id.startswith(p) for p in ignore))


def test_parse_ids_splits_on_commas_and_blanks() -> None:
    assert parse_ids(["dsf204, DSF3", "DSF1 DSF5"]) == ["DSF204", "DSF3", "DSF1", "DSF5"]
    with pytest.raises(ValueError):
        parse_ids(["DSF1234"])
