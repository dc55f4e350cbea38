"""`extends:`: deep merge (mappings merge, lists replace), relative paths, chains, cycles, missing files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.extends import MAX_CHAIN, deep_merge, load_document
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import InputError
from tests.conftest import ROOT

GOOD = ROOT / "tests" / "fixtures" / "good"


def _fail(path: Path) -> tuple[str, str, int, str]:
    with pytest.raises(InputError) as info:
        load_document(path)
    (diag,) = info.value.diagnostics
    return diag.rule, Path(diag.location.file).name, diag.location.line, diag.message


@pytest.mark.parametrize("path", sorted(GOOD.glob("*.yaml")), ids=lambda p: p.name)
def test_good_fixtures_validate_clean(path: Path) -> None:
    result = validate_file(path)
    assert not result.diagnostics, [f"{d.location} {d.rule} {d.message}" for d in result.diagnostics]


def test_chain_of_three_merges_mappings_and_replaces_lists() -> None:
    data, smap = load_document(GOOD / "chain-of-three.yaml")
    assert data["name"] == "chain-of-three"
    # from the middle file
    assert data["model"] == {"preset": "tiny-gpt2", "arch": "custom", "factory": "my_models.tiny:build"}
    assert data["hardware"]["gpus_per_node"] == 4  # from the bottom file, two directories away
    opt = data["training"]["optimizer"]
    assert opt == {"name": "adamw", "lr": 5.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    # the list is replaced, not merged
    assert data["rewrite"] == [{"match": ".*\\.mlp\\.c_fc$", "as": "column"}]
    assert "extends" not in data
    # positions follow the file each value came from
    assert Path(smap.locate(("training", "optimizer", "lr"), value=True).file).name == "chain-of-three.yaml"
    assert Path(smap.locate(("training", "optimizer", "betas"), value=True).file).name == "cluster.yaml"
    assert Path(smap.locate(("parallel", "tp"), value=True).file).name == "model.yaml"


def test_later_bases_win_over_earlier_and_the_file_over_both() -> None:
    data, _ = load_document(GOOD / "multiple-bases.yaml")
    assert data["parallel"]["tp"] == 1 and data["parallel"]["zero"] == 1
    assert data["model"]["preset"] == "tiny-gpt2"


def test_diagnostic_points_into_the_base_that_wrote_the_value(write_job) -> None:
    write_job("hardware: {preset: cpu-local, gpus_per_node: 4}\nparallel:\n  tp: 3\n", "base.yaml")
    job = write_job("extends: base.yaml\nversion: 1\nmodel: {preset: tiny-llama}\n")
    diags = validate_file(job).diagnostics
    tp = [d for d in diags if d.rule == "DSF103"]
    assert tp and Path(tp[0].location.file).name == "base.yaml" and tp[0].location.line == 3


def test_cycle_names_the_whole_chain(write_job) -> None:
    write_job("extends: b.yaml\nversion: 1\n", "a.yaml")
    write_job("extends: c.yaml\n", "b.yaml")
    write_job("extends: a.yaml\n", "c.yaml")
    rule, where, line, message = _fail(write_job("extends: b.yaml\nversion: 1\n", "a.yaml"))
    # The job file's own `extends:` line, and the included line that closes the cycle (issue 26).
    assert (rule, where, line) == ("DSF010", "a.yaml", 1)
    assert "a.yaml -> " in message and "b.yaml -> " in message and "c.yaml -> " in message
    assert "a.yaml (closed by `extends:` at " in message and message.rstrip().endswith(
        "c.yaml line 1, column 10)"
    )


def test_self_extends_is_a_cycle(write_job) -> None:
    assert _fail(write_job("version: 1\nextends: ./job.yaml\n"))[0] == "DSF010"


def test_missing_base_names_the_chain_and_the_directory(write_job, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_job("extends: ../nowhere.yaml\n", "sub/mid.yaml")
    rule, where, line, message = _fail(write_job("version: 1\nextends: sub/mid.yaml\n"))
    assert (rule, where, line) == ("DSF010", "mid.yaml", 1)
    assert "does not exist" in message and "mid.yaml -> " in message and "nowhere.yaml" in message


@pytest.mark.parametrize("value", ["[]", "3", "{a: b}", "['', x.yaml]", "[1]"])
def test_extends_must_name_files(write_job, value: str) -> None:
    assert _fail(write_job(f"version: 1\nextends: {value}\n"))[:3] == ("DSF010", "job.yaml", 2)


def test_chain_depth_is_bounded(write_job) -> None:
    for i in range(MAX_CHAIN + 1):
        write_job(f"extends: f{i + 1}.yaml\n", f"f{i}.yaml")
    write_job("version: 1\n", f"f{MAX_CHAIN + 1}.yaml")
    assert "deeper than" in _fail(write_job("extends: f0.yaml\n", "top.yaml"))[3]


def test_error_inside_a_base_is_reported_there(write_job) -> None:
    write_job("a: 1\na: 2\n", "base.yaml")
    assert _fail(write_job("extends: base.yaml\nversion: 1\n"))[:3] == ("DSF005", "base.yaml", 2)


# ---- deep_merge laws (hypothesis) ----

_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.booleans(), st.none(),
                  st.lists(st.integers(0, 3), max_size=3))
_doc = st.recursive(st.dictionaries(st.sampled_from("abcd"), _leaf, max_size=4),
                    lambda inner: st.dictionaries(st.sampled_from("abcd"), st.one_of(_leaf, inner),
                                                  max_size=4),
                    max_leaves=12)


def _paths(doc: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in doc.items():
        out[prefix + (key,)] = value
        if isinstance(value, dict):
            out.update(_paths(value, prefix + (key,)))
    return out


def _leaves(doc: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):  # an empty mapping has no leaves: merged, it changes nothing
            out.update(_leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


@settings(max_examples=120, deadline=None)
@given(_doc, _doc)
def test_merge_keeps_every_top_leaf_and_every_untouched_base_leaf(base: dict, top: dict) -> None:
    before = repr(base), repr(top)
    merged = _leaves(deep_merge(base, top))
    top_leaves = _leaves(top)
    for path, value in top_leaves.items():
        assert merged[path] == value  # the including file always wins
    written = _paths(top)
    for path, value in _leaves(base).items():
        # replaced if the including file writes this very key, or a non-mapping value above it
        shadowed = path in written or any(not isinstance(written.get(path[:i], {}),
                                                         dict) for i in range(1, len(path)))
        if not shadowed:
            assert merged[path] == value  # what the including file does not mention survives
    assert (repr(base), repr(top)) == before  # inputs are not mutated


@settings(max_examples=60, deadline=None)
@given(_doc, _doc, _doc)
def test_merge_identity_idempotence_and_sequential_chains(a: dict, b: dict, c: dict) -> None:
    assert deep_merge(a, {}) == a and deep_merge({}, a) == a
    assert deep_merge(a, a) == a
    assert deep_merge(deep_merge(a, b), b) == deep_merge(a, b)
    # A chain c -> b -> a is merged bottom-up; when no key changes kind (mapping vs value) along the way,
    # the grouping does not matter.
    chained = deep_merge(deep_merge(a, b), c)
    if _same_kinds(a, b) and _same_kinds(b, c) and _same_kinds(a, c):
        assert chained == deep_merge(a, deep_merge(b, c))


def _same_kinds(x: dict, y: dict) -> bool:
    for key in set(x) & set(y):
        if isinstance(x[key], dict) != isinstance(y[key], dict):
            return False
        if isinstance(x[key], dict) and not _same_kinds(x[key], y[key]):
            return False
    return True
