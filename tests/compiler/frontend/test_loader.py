"""The YAML loader: hostile or malformed input is an InputError with a position, never anything else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.source import MAX_DEPTH, MAX_FILE_BYTES, load_yaml, read_text
from dsforge.diagnostics import InputError


def _error(fn, *args) -> tuple[str, int, int]:
    with pytest.raises(InputError) as info:
        fn(*args)
    (diag,) = info.value.diagnostics
    return diag.rule, diag.location.line, diag.location.column


def _load(text: str) -> tuple[dict, object]:
    return load_yaml(text, "job.yaml")


def test_positions_of_keys_and_values() -> None:
    data, smap = _load("version: 1\nmodel:\n  preset: tiny\n  layers: [1, 2]\n")
    assert data == {"version": 1, "model": {"preset": "tiny", "layers": [1, 2]}}
    assert (smap.keys[("model", "preset")].line, smap.keys[("model", "preset")].column) == (3, 3)
    assert (smap.values[("model", "preset")].line, smap.values[("model", "preset")].column) == (3, 11)
    assert smap.values[("model", "layers", 1)].column == 15
    # an unwritten key falls back to its nearest written ancestor
    assert smap.locate(("model", "hidden")).line == 2


def test_duplicate_key_names_both_lines() -> None:
    with pytest.raises(InputError) as info:
        _load("version: 1\nparallel:\n  tp: 2\n  pp: 1\n  tp: 4\n")
    (diag,) = info.value.diagnostics
    assert (diag.rule, diag.location.line) == ("DSF005", 5)
    assert "first at line 3" in diag.message


def test_duplicate_keys_inside_flow_mapping() -> None:
    assert _error(_load, "a: {x: 1, x: 2}\n")[:2] == ("DSF005", 1)


@pytest.mark.parametrize("text", [
    "x: !!python/object/apply:os.system ['true']\n",
    "x: !!python/name:os.system\n",
    "x: !!binary aGVsbG8=\n",
    "x: !custom 3\n",
    "x: !!set {a, b}\n",
])
def test_object_constructing_and_unknown_tags_are_refused(text: str) -> None:
    assert _error(_load, text)[:2] == ("DSF006", 1)


def test_billion_laughs_is_refused_quickly() -> None:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    start = time.perf_counter()
    rule, line, _ = _error(_load, "\n".join(lines) + "\n")
    elapsed = time.perf_counter() - start
    assert rule == "DSF007" and line > 1
    assert elapsed < 1.0, f"bounded check took {elapsed:.2f} s"  # memoised: one visit per distinct node


def test_recursive_alias_is_refused() -> None:
    assert _error(_load, "a: &x\n  - *x\n")[:2] == ("DSF007", 1)
    assert _error(_load, "a: &m\n  self: *m\n")[0] == "DSF007"


@pytest.mark.parametrize("levels", [MAX_DEPTH + 2, 990])  # 990: below libyaml's limit, above Python's
                                                          # recursion
@pytest.mark.parametrize("anchor", ["", "x: &x 1\n"])
def test_deep_nesting_is_refused(levels: int, anchor: str) -> None:
    flow = anchor + "a: " + "[" * levels + "]" * levels + "\n"
    block = anchor + "".join("  " * i + "k:\n" for i in range(levels)) + "  " * levels + "k: 1\n"
    for text in (flow, block):
        rule, line, _ = _error(_load, text)
        assert rule == "DSF007" and line <= MAX_DEPTH + 3


def test_reused_alias_within_bounds_is_fine() -> None:
    data, _smap = _load("base: &b {x: 1}\nother: *b\n")
    assert data["other"] == {"x": 1}


def test_merge_keys_explicit_keys_win_and_keep_their_position() -> None:
    text = "defaults: &d {x: 1, y: 2}\nother: &o {y: 5, z: 6}\nc:\n  y: 3\n  <<: [*d, *o]\n"
    data, smap = _load(text)
    assert data["c"] == {"x": 1, "y": 3, "z": 6}  # explicit wins; earlier merge source wins over later
    assert smap.keys[("c", "y")].line == 4
    assert smap.keys[("c", "x")].line == 1 and smap.keys[("c", "z")].line == 2


def test_merge_key_must_name_a_mapping() -> None:
    assert _error(_load, "l: &l [1]\nc:\n  <<: *l\n")[0] == "DSF006"


def test_non_string_keys_become_strings_but_complex_keys_are_refused() -> None:
    data, _ = _load("1: a\ntrue: b\n")
    assert data == {"1": "a", "true": "b"}  # the key as written
    assert _error(_load, "? [a, b]\n: 1\n")[0] == "DSF006"


def test_syntax_error_points_at_the_problem() -> None:
    rule, line, _col = _error(_load, "version: 1\nmodel:\n  preset: x\n    layers: 4\n")
    assert (rule, line) == ("DSF004", 4)


def test_control_character_position() -> None:
    assert _error(_load, 'a: 1\nb: "x\x01y"\n') == ("DSF004", 2, 6)


@pytest.mark.parametrize("text, rule",
                         [("- 1\n- 2\n", "DSF009"), ("just text\n", "DSF009"), ("42\n", "DSF009"),
                                        ("---\n", "DSF008"), ("a: 1\n---\nb: 2\n", "DSF004")])
def test_top_level_must_be_one_mapping(text: str, rule: str) -> None:
    assert _error(_load, text)[0] == rule


def test_read_text_rejects_files(tmp_path: Path) -> None:
    def read(raw: bytes) -> tuple[str, int, int]:
        path = tmp_path / "job.yaml"
        path.write_bytes(raw)
        return _error(read_text, path, "job.yaml")

    assert read(b"") == ("DSF008", 1, 1)
    assert read(b"# only a comment\n\n   # another\n")[0] == "DSF008"
    assert read(b"a: 1\nb: caf\xe9\n") == ("DSF002", 2, 7)
    assert read(b"\xff\xfea\x00:\x00") [0] == "DSF002"  # UTF-16 is not UTF-8
    assert read(b"model:\n\tpreset: x\n") == ("DSF003", 2, 1)
    assert read(b"model:\n  \tpreset: x\n") == ("DSF003", 2, 3)
    assert _error(read_text, tmp_path / "nope.yaml", "nope.yaml")[0] == "DSF001"
    assert _error(read_text, tmp_path, "dir")[0] == "DSF001"


def test_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"a: 1\n" + b"# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    rule, line, _ = _error(read_text, path, "job.yaml")
    assert (rule, line) == ("DSF007", 0)


def test_utf8_bom_and_tabs_inside_values_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xef\xbb\xbfname: \"a\tb\"\n")
    assert load_yaml(read_text(path, "job.yaml"), "job.yaml")[0] == {"name": "a\tb"}


def test_timestamps_stay_strings() -> None:
    assert _load("t: 2024-01-01\n")[0] == {"t": "2024-01-01"}


# ---- property tests: whatever the bytes, the only exception is InputError ----

def _load_bytes(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(raw)
    try:
        load_yaml(read_text(path, "job.yaml"), "job.yaml")
    except InputError as exc:
        assert exc.diagnostics and all(d.rule.startswith("DSF0") for d in exc.diagnostics)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_input_error(tmp_path: Path, raw: bytes) -> None:
    _load_bytes(tmp_path, raw)


_YAMLISH = st.text(alphabet=st.sampled_from(list("ab:- \n\t[]{},&*!#'\"|>?%@`<=0123.\\")), max_size=200)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_YAMLISH)
def test_yaml_like_text_raises_only_input_error(tmp_path: Path, text: str) -> None:
    _load_bytes(tmp_path, text.encode("utf-8"))


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_unicode_text_raises_only_input_error(text: str) -> None:
    try:
        load_yaml(text, "job.yaml")
    except InputError:
        pass
