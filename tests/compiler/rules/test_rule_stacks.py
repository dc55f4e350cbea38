"""Rules about dsforge's own runtime are checked for `stack: dsforge` jobs only (issue 24, item 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, all_rules
from dsforge.compiler.validate import validate_file
from dsforge.docs_gen import render_rules
from tests.conftest import ROOT

BAD = ROOT / "tests" / "fixtures" / "bad"
RUNTIME_RULES = sorted(r.id for r in all_rules() if r.stacks == DSFORGE_RUNTIME)


def _fixtures(rid: str) -> list[Path]:
    return sorted(BAD.glob(f"{rid.lower()}-*.yaml"))


def test_the_runtime_rules_name_their_stack() -> None:
    # a check whose summary or source is about dsforge's runtime (its modules, "dsforge's runtime") is one
    assert {"DSF140", "DSF141", "DSF142", "DSF143", "DSF144", "DSF145", "DSF154", "DSF606", "DSF607"} <= set(
        RUNTIME_RULES)
    about_runtime = re.compile(r"dsforge's runtime|dsforge[./]runtime")
    # DSF126 cites dsforge/runtime/moe.py but is about the job file: it has no parallel.etp, and every stack's
    # estimate assumes the experts share the dense tensor-parallel groups
    every_stack = {"DSF126"}
    for r in all_rules():
        if (
            r.id not in every_stack
            and r.check is not None
            and r.origin == "dsforge"
            and about_runtime.search(r.summary + " " + r.source)
        ):
            assert r.stacks, f"{r.id} is about dsforge's runtime but applies to every stack"


@pytest.mark.parametrize("rid", [r for r in RUNTIME_RULES if _fixtures(r)])
def test_a_runtime_rule_refuses_its_fixture_under_dsforge_only(rid: str, tmp_path: Path) -> None:
    for fixture in _fixtures(rid):
        text = fixture.read_text(encoding="utf-8")
        if rid not in {d.rule for d in validate_file(fixture).diagnostics}:
            continue  # a compile-phase rule (DSF144, DSF607): validate does not run it
        other = tmp_path / fixture.name
        other.write_text("stack: megatron-te\n" + re.sub(r"(?m)^stack:.*\n", "", text), encoding="utf-8")
        found = {d.rule for d in validate_file(other).diagnostics}
        assert rid not in found, (fixture.name, found)


def test_rules_md_says_which_stack_each_rule_is_about() -> None:
    text = render_rules()
    sections = text.split('<a id="dsf')[1:]
    assert sections and all("*Stacks:* " in s for s in sections)
    dsf145 = next(s for s in sections if s.startswith('145"'))
    assert "*Stacks:* `dsforge`" in dsf145
    dsf301 = next(s for s in sections if s.startswith('301"'))
    assert "*Stacks:* every stack" in dsf301
