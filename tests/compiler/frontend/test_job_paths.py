"""Paths in a job file are relative to the job file's directory, resolved at load; missing files are
DSF610/611.

What is checked: a relative `training.data.path` and `training.checkpoint.dir` become absolute against
the directory of the file that wrote them (an `extends:` base: the base's), whatever the working
directory; absolute and `~` paths stay; a job from standard input resolves against the working
directory; plan.json records the absolute paths; a missing token file, a directory given as one, and
a checkpoint directory that is a file are diagnostics at validate time, with the line of the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.commands.compile import compile_file
from dsforge.compiler.frontend.job_paths import resolve_job_paths
from dsforge.compiler.frontend.parse import load_job, parse_job
from dsforge.compiler.frontend.source import load_yaml
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity

HEAD = """version: 1
name: paths
model: {preset: tiny-gpt2}
hardware: {preset: cpu-local, gpus_per_node: 2}
"""


def job(directory: Path, training: str, name: str = "job.yaml", head: str = HEAD) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(head + f"training: {training}\n", encoding="utf-8")
    return path


def tokens(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(4096))
    return path


def loaded(path: Path) -> tuple[str | None, str]:
    spec = load_job(path)[0]
    assert spec is not None
    return spec.spec.training.data.path, spec.spec.training.checkpoint.dir


def findings(path: Path, rule: str) -> list[tuple[Severity, int, str]]:
    return [(d.severity, d.location.line,
             d.message) for d in validate_file(path).diagnostics if d.rule == rule]


def test_relative_paths_resolve_against_the_job_files_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tokens(tmp_path / "jobs" / "data" / "train.bin")
    path = job(tmp_path / "jobs", "{data: {kind: tokens, path: data/train.bin}, checkpoint: {dir: ../ckpt}}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert loaded(Path(os.path.relpath(path))) == (str(tmp_path / "jobs" / "data" / "train.bin"),
                                                   str(tmp_path / "ckpt"))
    assert findings(path, "DSF610") == [] and findings(path, "DSF611") == []


def test_a_path_in_an_extends_base_is_relative_to_the_base(tmp_path: Path) -> None:
    tokens(tmp_path / "common" / "train.bin")
    (tmp_path / "common").mkdir(exist_ok=True)
    (tmp_path / "common" / "base.yaml").write_text(
        HEAD + "training: {data: {kind: tokens, path: train.bin}}\n", encoding="utf-8")
    path = tmp_path / "team" / "job.yaml"
    path.parent.mkdir()
    path.write_text("version: 1\nextends: ../common/base.yaml\ntraining: {checkpoint: {dir: ckpt}}\n",
                    encoding="utf-8")
    assert loaded(path) == (str(tmp_path / "common" / "train.bin"), str(tmp_path / "team" / "ckpt"))


def test_absolute_home_and_default_paths_stay_as_written(tmp_path: Path) -> None:
    data = tokens(tmp_path / "abs" / "train.bin")
    path = job(tmp_path / "jobs", f"{{data: {{kind: tokens, path: {data}}}, checkpoint: {{dir: ~/ckpt}}}}")
    assert loaded(path) == (str(data), "~/ckpt")
    # inside the job directory
    assert loaded(job(tmp_path / "jobs", "{steps: 3}", "plain.yaml"))[1] == "checkpoints"


def test_a_job_from_standard_input_resolves_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    raw, smap = load_yaml(HEAD + "training: {data: {kind: tokens, path: data/t.bin}}\n", "<stdin>")
    spec, diags = parse_job(raw, smap)
    assert spec is not None and not diags
    assert resolve_job_paths(spec, raw, smap).training.data.path == str(tmp_path / "data" / "t.bin")


def test_plan_json_records_absolute_paths(tmp_path: Path) -> None:
    tokens(tmp_path / "jobs" / "train.bin")
    path = job(tmp_path / "jobs", "{data: {kind: tokens, path: train.bin}, checkpoint: {dir: ckpt}}")
    result = compile_file(path, tmp_path / "out", rewrite=False)
    assert result.written is not None, [d.message for d in result.diagnostics]
    training = json.loads((result.written / "plan.json").read_text(encoding="utf-8"))["job"]["training"]
    assert training["data"]["path"] == str(tmp_path / "jobs" / "train.bin")
    assert training["checkpoint"]["dir"] == str(tmp_path / "jobs" / "ckpt")


def test_missing_token_file_is_dsf610_at_its_line(tmp_path: Path) -> None:
    path = job(tmp_path, "{steps: 2,\n  data: {kind: tokens, path: data/missing.bin}}")
    [(severity, line, message)] = findings(path, "DSF610")
    assert severity == Severity.ERROR and line == 6
    assert str(tmp_path / "data" / "missing.bin") in message and "'data/missing.bin'" in message
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 1 and f"{path}:6:" in result.output and "error[DSF610]" in result.output
    assert "Traceback" not in result.output
    assert compile_file(path, tmp_path / "out", rewrite=False).written is None  # nothing is written


def test_missing_absolute_token_file_is_a_warning_and_a_directory_an_error(tmp_path: Path) -> None:
    path = job(tmp_path, f"{{data: {{kind: tokens, path: {tmp_path / 'cluster' / 'train.bin'}}}}}")
    [(severity, _, message)] = findings(path, "DSF610")
    assert severity == Severity.WARNING and "on this machine" in message  # may be a mount of the nodes only
    (tmp_path / "dir.bin").mkdir()
    [(severity, _, message)] = findings(job(tmp_path, "{data: {kind: tokens, path: dir.bin}}", "d.yaml"),
                                        "DSF610")
    assert severity == Severity.ERROR and "is a directory" in message
    assert findings(job(tmp_path, "{data: {kind: synthetic, path: nowhere.bin}}", "s.yaml"), "DSF610") == []


def test_checkpoint_dir_that_is_a_file_is_dsf611(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    [(severity, line, message)] = findings(job(tmp_path, "{checkpoint: {dir: notes.txt}}"), "DSF611")
    assert severity == Severity.ERROR and line == 5 and "is a file" in message
    [(_, _, message)] = findings(job(tmp_path, "{checkpoint: {dir: notes.txt/run1}}", "b.yaml"), "DSF611")
    assert f"lies under {tmp_path / 'notes.txt'}" in message
    # created at the save
    assert findings(job(tmp_path, "{checkpoint: {dir: new/run1}}", "c.yaml"), "DSF611") == []


SEGMENT = st.text(st.sampled_from("abcXYZ019_-. "), min_size=1,
                  max_size=8).filter(lambda s: s not in (".", ".."))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(SEGMENT, st.just("..")), min_size=1, max_size=4), absolute=st.booleans())
def test_any_relative_path_becomes_the_job_directory_joined_with_it(tmp_path: Path, parts: list[str],
                                                                    absolute: bool) -> None:
    value = ("/" if absolute else "") + "/".join(parts)
    raw, smap = load_yaml(HEAD + f"training: {{checkpoint: {{dir: {json.dumps(value)}}}}}\n",
                          str(tmp_path / "j.yaml"))
    spec, _ = parse_job(raw, smap)
    assert spec is not None
    resolved = resolve_job_paths(spec, raw, smap).training.checkpoint.dir
    assert os.path.isabs(resolved)
    assert resolved == (value if absolute else os.path.normpath(os.path.join(tmp_path, value)))
