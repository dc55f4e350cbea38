"""`-` as the job file: validate, explain and compile read standard input, with every loader check.

A CI step that generates a job (a template, a sweep) pipes it in instead of writing a temporary file;
its diagnostics must be the ones the same bytes get from a file, named `<stdin>`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.compiler.frontend.source import MAX_FILE_BYTES, STDIN_NAME, read_stream
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import InputError
from tests.conftest import ROOT

BAD = ROOT / "tests" / "fixtures" / "bad"
GOOD = b"version: 1\nname: piped\nmodel: {preset: tiny-llama}\nhardware: {preset: cpu-local}\n"


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def _found(diags: list[Any], name: str) -> list[tuple[str, str, str, int, int]]:
    """The diagnostics with the main file's name replaced, so a file and stdin compare equal."""
    return sorted((d.rule, d.severity.value, STDIN_NAME if d.location.file == name else d.location.file,
                   d.location.line, d.location.column) for d in diags)


def test_validate_reads_stdin_and_names_it() -> None:
    ok = CliRunner().invoke(cli, ["validate", "-"], input=GOOD)
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(cli, ["validate", "-"], input=GOOD.replace(b"cpu-local", b"cpu-locl"))
    assert bad.exit_code == 1
    assert bad.output.startswith("<stdin>:4:20: error[DSF025] unknown hardware preset 'cpu-locl'"), bad.output


def test_stdin_next_to_files_and_only_once() -> None:
    mixed = CliRunner().invoke(cli, ["validate", str(BAD / "dsf104-tp-kv-heads.yaml"), "-"], input=b"a: [\n")
    assert mixed.exit_code == 2 and "DSF104" in mixed.output and "<stdin>:2:1: error[DSF004]" in mixed.output
    twice = CliRunner().invoke(cli, ["validate", "-", "-"], input=GOOD)
    assert twice.exit_code == 2 and "at most once" in twice.output


#: A file in an `extends` cycle is not itself when piped in: the cycle closes one file later, in a file.
CYCLES = {"dsf010-extends-cycle-a.yaml", "dsf010-extends-cycle-b.yaml", "dsf010-extends-self.yaml"}


@pytest.mark.parametrize("name", sorted(p.name for p in BAD.glob("*.yaml")))
def test_every_corpus_file_gets_the_same_diagnostics_from_stdin(name: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # From the corpus folder, `extends:` relative to the working directory finds what the file finds.
    monkeypatch.chdir(BAD)
    from_file = validate_file(name)
    _stdin(monkeypatch, (BAD / name).read_bytes())
    from_stdin = validate_file("-")
    assert from_stdin.unusable == from_file.unusable
    if name in CYCLES:
        assert [d.rule for d in from_stdin.diagnostics] == ["DSF010"]
        assert "forms a cycle" in from_stdin.diagnostics[0].message
    else:
        assert _found(from_stdin.diagnostics, STDIN_NAME) == _found(from_file.diagnostics, name)


def test_extends_resolves_against_the_working_directory(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "base.yaml").write_text("version: 1\nmodel: {preset: tiny-llama}\nhardware: {preset: "
                                        "cpu-local}\nparallel: {tp: 3}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    _stdin(monkeypatch, b"extends: base.yaml\nname: child\n")
    result = validate_file("-")
    # the base's tp=3 (heads 4) is reported in the base, where it is written
    assert [(d.rule, d.location.file, d.location.line) for d in result.diagnostics if d.rule == "DSF103"] == [
        ("DSF103", "base.yaml", 4)]
    _stdin(monkeypatch, b"version: 1\nextends: nope.yaml\n")
    missing = validate_file("-")
    [diag] = missing.diagnostics
    assert missing.unusable and diag.rule == "DSF010" and diag.location.file == STDIN_NAME
    assert "<stdin> -> nope.yaml" in diag.message and "relative to the working directory" in diag.fix


class _Endless(io.RawIOBase):
    """A writer that never stops: counts what the reader takes."""

    def __init__(self) -> None:
        self.taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), 65536)  # short reads, as a pipe gives them
        buffer[:n] = b"#" * n
        self.taken += n
        return n


def test_stdin_is_read_bounded() -> None:
    stream = _Endless()
    with pytest.raises(InputError) as err:
        read_stream(stream)  # type: ignore[arg-type]
    assert stream.taken == MAX_FILE_BYTES + 1
    [diag] = err.value.diagnostics
    assert diag.rule == "DSF007" and diag.location.file == STDIN_NAME
    # exactly at the limit is still a job file (here: one made of comments, so empty)
    with pytest.raises(InputError) as err:
        read_stream(io.BytesIO(b"#" * MAX_FILE_BYTES))
    assert err.value.diagnostics[0].rule == "DSF008"


def test_closed_stdin_is_a_diagnostic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", None)
    result = validate_file("-")
    assert result.unusable and [d.rule for d in result.diagnostics] == ["DSF001"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=200),
                 st.lists(st.sampled_from([b"version: 1\n", b"model: {preset: tiny-llama}\n", b"\t", b"  ",
                                           b"&a ", b"*a", b"\xff", b"\xef\xbb\xbf", b"key: [", b"# c\n",
                                           b"x: 1\n", b"\n"]),
                          max_size=8).map(b"".join)))
def test_stdin_and_a_file_agree_on_any_bytes(data: bytes, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    from_file = validate_file(path)
    _stdin(monkeypatch, data)
    from_stdin = validate_file("-")
    assert from_stdin.unusable == from_file.unusable
    assert _found(from_stdin.diagnostics, STDIN_NAME) == _found(from_file.diagnostics, str(path))


def test_explain_and_compile_read_stdin(tmp_path: Path) -> None:
    explained = CliRunner().invoke(cli, ["explain", "-", "--format", "json"], input=GOOD)
    assert explained.exit_code == 0, explained.output
    assert json.loads(explained.output)["job"] == "piped"
    out = tmp_path / "job"
    compiled = CliRunner().invoke(cli, ["compile", "-", "-o", str(out), "--no-rewrite"], input=GOOD)
    assert compiled.exit_code == 0, compiled.output
    assert json.loads((out / "plan.json").read_text(encoding="utf-8"))["name"] == "piped"


def test_a_real_pipe(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "dsforge", "validate", "-"], check=False,
                          input=b"version: 1\nmodel: 3\nhardware: {preset: cpu-local}\n", capture_output=True,
                          cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.decode().startswith("<stdin>:2:8: error[DSF021]")
