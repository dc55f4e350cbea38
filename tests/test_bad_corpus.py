"""The bad-job corpus: every fixture gets the right rule id on the right line, through the API and the CLI.

The expected diagnostics live in tests/fixtures/bad/expected.json (regenerate with
`python scripts/update_snapshots.py` after an intended change, and read the diff). Rules registered
after the snapshot was taken are ignored by the comparison until it is regenerated, so a new rule
elsewhere cannot break this test; the coverage test below still asks for a fixture for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.rules.registry import all_rules
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity
from tests.conftest import ROOT, load_script

BAD = ROOT / "tests" / "fixtures" / "bad"
SNAPSHOT: dict[str, Any] = json.loads((BAD / "expected.json").read_text(encoding="utf-8"))
FIXTURES = sorted(SNAPSHOT["files"])
LOADER_IDS = [f"DSF{n:03d}" for n in range(1, 11)]  # unusable input, exit code 2
SCHEMA_IDS = [f"DSF{n:03d}" for n in range(20, 26)]
#: Registered ids no job file given to `validate` can produce, each with where it is tested instead.
NOT_FROM_A_JOB_FILE = {
    "DSF702": "a trainer plugin's refusal at start-up, not validate: tests/plugins/test_parallel_model.py",
    "DSF703": "a trainer plugin's refusal at start-up, not validate: tests/plugins/test_parallel_model.py",
    "DSF704": "a trainer plugin's refusal at start-up, not validate: tests/plugins/test_parallel_model.py",
    "DSF705": "a trainer plugin's refusal at start-up, not validate: tests/plugins/test_parallel_model.py",
    "DSF706": "the HF Trainer and Accelerate plugins' refusal at start-up, not validate: "
              "tests/plugins/test_hf.py, tests/plugins/test_accelerate.py",
    "DSF707": "the HF Trainer and Accelerate plugins' refusal at start-up, not validate: "
              "tests/plugins/test_hf.py, tests/plugins/test_accelerate.py",
    "DSF708": "the Accelerate plugin's refusal of a ParallelismConfig, not validate: "
              "tests/plugins/test_accelerate.py",
    "DSF716": "Lightning's mid-epoch resume refusal at load_checkpoint, not validate: "
              "tests/plugins/test_lightning.py",
    "DSF027": "a project settings file, not a job file: tests/compiler/rules/test_suppress.py",
    "DSF144": "compile only, from the model the rewrite plan builds on the meta device: "
              "tests/compiler/rules/test_runtime_refusals.py",
    "DSF600": "compile only, where no search resolved an `auto` (validate resolves it first, or reports "
              "DSF120/DSF13x): tests/commands/test_compile_refusals.py",
    "DSF607": "compile only, from the rewrite plan torch computes: tests/commands/test_compile_rewrite.py",
    "DSF640": "a rank loading model.pretrained, at start-up: tests/runtime/test_materialize.py",
    **{rid: "the rewrite of an HF model by its own parallel plans (compile's meta build, a rank); in a "
            "pretrained job's DSF012 message: tests/compiler/model/test_hf_plans.py, "
            "tests/runtime_rewrite/test_derived_policies.py"
       for rid in ("DSF170", "DSF171", "DSF172")},
    **{rid: "a new compile against the one that wrote a checkpoint (dsforge run, a rank's resume): "
            "tests/compiler/plan/test_resume_layout.py" for rid in ("DSF164", "DSF165", "DSF166", "DSF167")},
    **{rid: "a rank reading a checkpoint's layout-free state: tests/runtime/test_train_state.py, "
            "tests/runtime_e2e/test_export.py" for rid in ("DSF641", "DSF642", "DSF643")},
    "DSF626": "an optional package (pyarrow, datasets) absent, which the test environment has: "
              "tests/compiler/rules/test_data_rules.py",
    "DSF690": "the cost model failing on a valid job (internal): tests/commands/test_compile.py",
    "DSF691": "the rewrite planner failing on a valid job (internal): tests/commands/test_compile_rewrite.py",
    "DSF699": "the emitter or a plugin launch target failing: tests/commands/test_compile_refusals.py",
    "DSF701": "a broken plugin installation: tests/plugins/test_fixture_plugin.py",
    "DSF900": "a crashing rule: tests/compiler/rules/test_rules.py",
    **{rid: "the machine a run meets (a busy directory, the disk, a damaged checkpoint, a build lock): "
            "tests/runtime/test_run_lock.py, tests/runtime/test_checkpoint_integrity.py, "
            "tests/runtime_e2e/test_machine_faults.py"
       for rid in ("DSF612", "DSF614", "DSF615", "DSF616", "DSF617")},
    "DSF613": "two job files validated together (a cross-file check): tests/runtime/test_run_lock.py",
}
REGENERATE = "if the change is intended, run `python scripts/update_snapshots.py` and review the diff"


def _named_rule(name: str) -> str:
    match = re.match(r"dsf(\d{3})-", name)
    return f"DSF{match.group(1)}" if match else "DSF001"  # the virtual missing-file entry


def _observed(name: str) -> list[list[Any]]:
    known = set(SNAPSHOT["rules"]) | set(LOADER_IDS) | set(SCHEMA_IDS)
    out: list[list[Any]] = []
    for d in validate_file(BAD / name).diagnostics:
        if d.rule not in known:
            continue  # registered after the snapshot (another stage's rule)
        entry: list[Any] = [d.rule, d.location.line]
        if Path(d.location.file).name != name:
            entry.append(Path(d.location.file).name)
        out.append(entry)
    return out


def test_corpus_is_large_and_every_file_is_in_the_snapshot() -> None:
    on_disk = {p.name for p in BAD.glob("*.yaml")}
    assert len(on_disk) >= 40
    assert on_disk <= set(FIXTURES), (f"fixtures missing from the snapshot: "
                                      f"{on_disk - set(FIXTURES)}; {REGENERATE}")
    assert not (BAD / "missing-file.yaml").exists(), "the DSF001 entry must stay a file that does not exist"


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_reports_its_rule_on_the_snapshot_line(name: str) -> None:
    observed = _observed(name)
    assert observed == SNAPSHOT["files"][name], REGENERATE
    assert _named_rule(name) in {entry[0] for entry in observed}, f"{name} should trigger {_named_rule(name)}"
    assert all(line >= 1 or rule == "DSF001" for rule, line, *_ in observed), "every finding needs a line"


def _expected_exit(name: str) -> int:
    diags = validate_file(BAD / name).diagnostics
    if any(d.rule in LOADER_IDS for d in diags):
        return 2
    return 1 if any(d.severity in (Severity.ERROR, Severity.WARNING) for d in diags) else 0


@pytest.mark.parametrize("name", FIXTURES)
def test_cli_reports_fixture_without_traceback(name: str) -> None:
    result = CliRunner().invoke(cli, ["validate", "--strict", "--format", "json", str(BAD / name)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert result.exit_code == _expected_exit(name)
    report = json.loads(result.output)
    rules = [d["rule"] for d in report["diagnostics"]]
    assert _named_rule(name) in rules and "DSF900" not in rules


def test_exit_codes_cover_all_three_outcomes() -> None:
    codes = {_expected_exit(name) for name in FIXTURES}
    assert codes == {0, 1, 2}  # info-only fixtures pass even with --strict


def test_every_registered_rule_has_a_bad_fixture() -> None:
    covered = {entry[0] for diags in SNAPSHOT["files"].values() for entry in diags}
    missing_input = sorted(set(LOADER_IDS + SCHEMA_IDS) - covered)
    assert not missing_input, f"loader/schema ids without a bad fixture: {missing_input}"
    registered = {r.id for r in all_rules() if r.origin == "dsforge"}
    missing = sorted(registered - covered - set(NOT_FROM_A_JOB_FILE))
    assert not missing, f"rules without a bad fixture in tests/fixtures/bad/: {missing}"
    assert set(NOT_FROM_A_JOB_FILE) <= registered, "an exception names an id that is no longer registered"


def test_update_script_writes_the_stored_format_over_every_fixture() -> None:
    module = load_script(ROOT / "scripts" / "update_snapshots.py", "update_snapshots")
    assert module.fixture_names() == FIXTURES
    assert module.render(SNAPSHOT) == (BAD / "expected.json").read_text(encoding="utf-8")
    # A diagnostic in another file than the fixture names that file (a preset file's own line)...
    name = "dsf304-preset-file-extra-section.yaml"
    assert module.diagnose(name) == [["DSF304", 8, "dsf304-preset-file-extra-section.yml"]]
    # ...and an `extends` cycle is the job file's own `extends:` line, the far end named in the message (issue
    # 26).
    assert module.diagnose("dsf010-extends-cycle-a.yaml") == [["DSF010", 2]]
