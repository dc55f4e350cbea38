"""Entry-point discovery: the fast scan finds what importlib.metadata finds, lazily and without torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from dsforge import extensions as registry
from dsforge.cli import cli
from tests.plugins.conftest import install_fixture_plugin, run

FIXTURE_ENTRIES = {
    ("presets", "fixture", "dsforge_fixture_plugin.presets:PRESETS"),
    ("presets", "wrong-kind", "dsforge_fixture_plugin.presets:wrong_kind"),
    ("rules", "fixture", "dsforge_fixture_plugin.rules"),
    ("rules", "broken", "dsforge_fixture_plugin.broken"),
    ("policies", "tinynet", "dsforge_fixture_plugin.policy:TINYNET"),
    ("launchers", "fixture-batch", "dsforge_fixture_plugin.launcher:TARGET"),
}


def test_scan_finds_every_entry_point_with_its_distribution(plugin_site: Path) -> None:
    found = registry.discover([str(plugin_site)])
    assert {(e.kind, e.name, e.value) for e in found} == FIXTURE_ENTRIES
    assert {(e.dist, e.version) for e in found} == {("dsforge-fixture-plugin", "0.1.0")}
    assert all(e.location.endswith("dsforge_fixture_plugin-0.1.0.dist-info") for e in found)


def test_scan_agrees_with_importlib_metadata(plugin_env: dict[str, str]) -> None:
    """The ~2 ms scan must see what the standard (~30 ms) API sees, including this venv's own packages."""
    code = ("import importlib.metadata as m, json; from dsforge import extensions as r\n"
            "std = sorted([g, e.name, e.value] for g in r.GROUPS.values() for e in m.entry_points(group=g))\n"
            "fast = sorted([r.GROUPS[e.kind], e.name, e.value] for e in r.discover())\n"
            "print(json.dumps([std, fast]))")
    proc = run([sys.executable, "-c", code], plugin_env)
    std, fast = json.loads(proc.stdout)
    assert std == fast and len(fast) == len(FIXTURE_ENTRIES)


def test_first_copy_of_a_distribution_on_the_path_wins(tmp_path: Path) -> None:
    first, second = install_fixture_plugin(tmp_path / "a"), install_fixture_plugin(tmp_path / "b")
    found = registry.discover([str(first), str(second)])
    assert {Path(e.location).parent for e in found} == {first}


def test_entry_points_file_parsing_skips_comments_and_other_groups() -> None:
    text = "# comment\n[console_scripts]\nx = y:z\n\n[dsforge.rules]\n; note\nteam = team_rules.checks\n"
    assert list(registry._parse_entry_points(text)) == [("console_scripts", "x", "y:z"),
                                                        ("dsforge.rules", "team", "team_rules.checks")]


def test_plugins_command_without_plugins_says_so_and_exits_0() -> None:
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "no dsforge plugins installed" in result.output and "dsforge.rewrite_policies" in result.output


def test_validate_and_listing_stay_torch_free_and_load_lazily(plugin_env: dict[str, str],
                                                              tmp_path: Path) -> None:
    """Plugins are read on the first preset/rule lookup, and reading them imports neither torch nor the
    trainers."""
    job = tmp_path / "job.yaml"
    job.write_text("version: 1\nname: team-x\nmodel: {preset: "
                   "fixture-tinynet}\nhardware: {preset: fixture-cpu-box}\n",
                   encoding="utf-8")
    code = ("import sys; from dsforge import extensions as r\n"
            "import dsforge.compiler.validate as v; before = dict(r._records)\n"
            f"res = v.validate_file({str(job)!r}); import dsforge.commands.plugins as p; p.plugin_report()\n"
            "heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'accelerate', 'lightning') if m in "
            "sys.modules]\nprint(before == {}, sorted({d.rule for d in res.diagnostics}), heavy)")
    proc = run([sys.executable, "-c", code], plugin_env)
    assert proc.stdout.strip() == "True ['DSF701'] []", proc.stdout + proc.stderr
