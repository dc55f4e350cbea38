"""The fixture plugin installed: its preset, rule, rewrite policy and launcher show up and work; the broken
entry points are reported by name and skipped while the rest load."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from tests.plugins.conftest import DSFORGE, no_traceback, run

JOB = """\
version: 1
name: {name}
model: {{preset: {model}}}
hardware: {{preset: fixture-cpu-box}}
parallel: {{tp: 2, zero: 1}}
training: {{global_batch: 8, micro_batch: 2}}
launch: {{launcher: {launcher}}}
"""


def write_job(tmp: Path, name: str = "team-demo", model: str = "tiny-llama", launcher: str = "local") -> Path:
    path = tmp / f"{name}-{launcher}.yaml"
    path.write_text(JOB.format(name=name, model=model, launcher=launcher), encoding="utf-8")
    return path


def test_plugins_lists_each_entry_point_its_origin_and_the_broken_ones(plugin_env: dict[str, str]) -> None:
    proc = run([*DSFORGE, "plugins"], plugin_env)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # two entry points fail on purpose
    out = proc.stdout
    assert "dsforge-fixture-plugin 0.1.0" in out and "dsforge_fixture_plugin-0.1.0.dist-info" in out
    for added in ("hardware preset fixture-cpu-box", "models preset fixture-tinynet", "rule FIX001",
                  "rewrite policy tinynet", "launcher fixture-batch"):
        assert added in out
    assert ("broken = dsforge_fixture_plugin.broken\n      FAILED, "
            "skipped: RuntimeError: fixture plugin is broken") in out
    assert "wrong-kind" in out and "kind 'gpus'" in out
    assert out.rstrip().endswith("6 entry point(s): 4 loaded, 2 failed")
    report = json.loads(run([*DSFORGE, "plugins", "--format", "json"], plugin_env).stdout)
    assert {(p["name"], p["ok"]) for p in report["plugins"]} == {
        ("fixture", True), ("wrong-kind", False), ("broken", False), ("tinynet", True),
        ("fixture-batch", True)}


def test_preset_and_rule_work_in_validate_and_broken_plugins_are_warnings(plugin_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    proc = run([*DSFORGE, "validate", "--format", "json", str(write_job(tmp_path, name="demo"))], plugin_env)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the 4-rank preset fills tp=2 x dp=2
    diags = json.loads(proc.stdout)["diagnostics"]
    by_rule = {d["rule"]: d for d in diags}
    assert by_rule["FIX001"]["severity"] == "warning" and by_rule["FIX001"]["line"] == 2
    assert "team-demo" in by_rule["FIX001"]["fix"]
    broken = [d["message"] for d in diags if d["rule"] == "DSF701"]
    assert len(broken) == 2 and any("'broken'" in m and "broken on purpose" in m for m in broken)
    strict = run([*DSFORGE, "validate", "--strict", str(write_job(tmp_path, name="team-ok"))], plugin_env)
    # only the broken plugins' warnings remain
    assert strict.returncode == 1 and "FIX001" not in strict.stdout


def test_plugin_presets_are_listed_with_their_origin(plugin_env: dict[str, str]) -> None:
    table = json.loads(run([*DSFORGE, "presets", "--format", "json"], plugin_env).stdout)
    assert table["hardware"]["fixture-cpu-box"]["origin"] == "plugin dsforge-fixture-plugin 0.1.0"
    assert table["models"]["fixture-tinynet"]["spec"]["factory"] == "dsforge_fixture_plugin.model:build"
    assert table["hardware"]["cpu-local"]["origin"].startswith("dsforge/")
    assert "fixture-nonsense" not in json.dumps(table)  # the refused preset registered nothing


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_launch_target_and_rewrite_policy_work_in_compile(plugin_env: dict[str, str], tmp_path: Path) -> None:
    """`launch.launcher: fixture-batch` writes the plugin's submit.sh; TinyNet (the plugin's model, built by
    its factory, `arch: auto`) is recognised as the plugin's family and sharded for tp=2 in plan.json's
    rewrite plan."""
    out = tmp_path / "job-dir"
    job = write_job(tmp_path, model="fixture-tinynet", launcher="fixture-batch")
    proc = run([*DSFORGE, "compile", str(job), "-o", str(out)], plugin_env)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    submit = out / "submit.sh"
    assert os.access(submit, os.X_OK)
    # the target sees launch.python filled in: the interpreter that ran `dsforge compile` (DSFORGE's)
    python = shlex.quote(os.path.abspath(DSFORGE[0]))
    assert (f"exec fixture-submit --name team-demo --ranks 4 -- {python} -m "
            f"torch.distributed.run") in submit.read_text()
    readme = (out / "README.md").read_text()
    assert "./submit.sh" in readme and "`submit.sh`: submits the job to fixture-submit" in readme
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "ds_config.json", "plan.json", "submit.sh",
                                                     "train.py"]
    rewrite = json.loads((out / "plan.json").read_text())["rewrite"]
    assert rewrite["ok"] and rewrite["arch"] == "tinynet" and rewrite["layer_list"] == "blocks"
    mods = {m["name"]: m for m in rewrite["modules"]}
    shards = {name: {p: v["shard"] for p, v in m["params"].items()} for name, m in mods.items()}
    assert (mods["blocks.1.qkv"]["variant"], mods["blocks.1.qkv"]["rule"], mods["blocks.1.qkv"]["layer"]) == (
        "column", "tinynet[3]", 1)
    assert shards["blocks.0.qkv"] == {"weight": [96, 64], "bias": [96]}  # 3 x 64 outputs, half per rank
    assert shards["blocks.0.out"] == {"weight": [64, 32], "bias": [64]}  # row: inputs split, bias whole
    assert shards["tok"] == {"weight": [128, 64]} and shards["head"] == {"weight": [128, 64]}
    assert mods["pos"]["variant"] == "replicate" and mods["final_norm"]["variant"] == "norm"


def test_misspelt_launcher_suggests_plugin_targets_too(plugin_env: dict[str, str], tmp_path: Path) -> None:
    proc = run([*DSFORGE, "validate", str(write_job(tmp_path, launcher="fixture-bach"))], plugin_env)
    no_traceback(proc)
    assert proc.returncode == 1
    assert "error[DSF023] `launch.launcher` is 'fixture-bach'" in proc.stdout
    assert "did you mean `fixture-batch`?" in proc.stdout
