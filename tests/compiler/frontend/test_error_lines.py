"""The two broken job files that named the wrong line: an open flow collection and an `extends` cycle.

An open `[` or `{` is reported at the line it opened, the message naming where the parser gave up
(dsforge.compiler.yaml_flow); a cycle closed in an included file is reported at the job file's own
`extends:` line, the message naming the line that closes it (dsforge.compiler.extends_cycle). Both
are drawn by hypothesis at any position; the bad corpus holds one fixed case of each
(tests/fixtures/bad/dsf004-unclosed-flow*.yaml, dsf010-extends-cycle-*.yaml), which the fuzz seeds include.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.extends import load_document
from dsforge.compiler.frontend.source import load_yaml
from dsforge.diagnostics import InputError


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 6), st.integers(0, 5),
       st.sampled_from(["{preset: tiny-llama", "[tp, dp", "{a: [1, 2]"]), st.integers(0, 4))
def test_an_open_flow_collection_names_the_line_it_opened(before: int, blank: int, flow: str,
                                                          indent: int) -> None:
    lines = [f"k{i}: {i}" for i in range(before)] + [f"opened:{' ' * (1 + indent)}{flow}"] + [""] * blank
    lines += ["hardware:", "  preset: cpu-local"]
    with pytest.raises(InputError) as info:
        load_yaml("\n".join(lines) + "\n", "job.yaml")
    d = info.value.diagnostics[0]
    opened = before + 1
    assert d.rule == "DSF004" and d.location.line == opened, d
    assert d.location.column == len("opened:") + 2 + indent
    gave_up = before + blank + 2
    assert f"opened at line {opened}," in d.message and f"gave up at line {gave_up}," in d.message, d.message


def test_a_closed_flow_collection_on_one_line_keeps_the_parsers_position() -> None:
    with pytest.raises(InputError) as info:
        load_yaml("a: {b: 1 c: 2}\n", "job.yaml")
    assert (
        info.value.diagnostics[0].location.line == 1 and "opened at" not in info.value.diagnostics[0].message
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(2, 5), st.integers(0, 4), st.integers(0, 4))
def test_a_cycle_closed_in_an_included_file_names_the_job_files_own_line(
        tmp_path_factory: pytest.TempPathFactory, length: int, pad: int, closes_at: int) -> None:
    folder = tmp_path_factory.mktemp("cycle")
    names = [f"f{i}.yaml" for i in range(length)]
    # f0 -> f1 -> ... -> f{n-1} -> f1: the cycle closes in the last base, not in the job file f0.
    for i, name in enumerate(names):
        parent = names[i + 1] if i + 1 < length else names[1]
        head = "\n" * (pad if i == 0 else closes_at if i == length - 1 else 0)
        (folder / name).write_text(f"{head}extends: {parent}\nversion: 1\n", encoding="utf-8")
    if length == 2:  # f1 -> f1 is a self-extension, found in f1 itself
        (folder / names[1]).write_text("\n" * closes_at + f"extends: {names[1]}\nversion: 1\n",
                                       encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_document(Path(folder / names[0]))
    d = info.value.diagnostics[0]
    assert d.rule == "DSF010" and "forms a cycle" in d.message
    assert Path(d.location.file).name == names[0] and d.location.line == pad + 1, d
    assert f"{names[-1]} line {closes_at + 1}, column 10)" in d.message, d.message
