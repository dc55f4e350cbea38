"""The console samples of README.md and docs/*.md are dsforge's real output (scripts/readme_samples.py).

When `test_samples_are_current` fails, a command's output changed: run `python scripts/readme_samples.py`,
read the diff of the Markdown files, and commit it. The other tests pin the script's own behaviour and the
parts of the README that other tools read (the two command blocks, the action and hook snippets, links).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import ROOT, load_script

SCRIPT = ROOT / "scripts" / "readme_samples.py"
samples = load_script(SCRIPT, "readme_samples")
checker = load_script(ROOT / "scripts" / "check_readme_commands.py", "check_readme_commands")

README = ROOT / "README.md"
DSF104 = "tests/fixtures/bad/dsf104-tp-kv-heads.yaml"


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_samples_are_current() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"stale or failing samples (run `python "
                                  f"scripts/readme_samples.py`):\n{done.stdout}")


def test_a_stale_sample_is_reported_and_rewritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"Intro.\n\n<!-- sample[rc=1 head=1]: dsforge validate {DSF104} -->\n```console\n"
                    "$ dsforge validate job.yaml\nold output\n```\n\nEnd.\n", encoding="utf-8")
    assert samples.main(["--check", str(page)]) == 1
    out = capsys.readouterr().out
    assert "-old output" in out and "+$ dsforge validate" in out and "stale" in out
    assert samples.main([str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("Intro.\n\n<!-- sample") and text.endswith("```\n\nEnd.\n")
    block = text.split("```console\n")[1].split("```")[0].splitlines()
    assert block[0] == f"$ dsforge validate {DSF104}"
    assert block[1].startswith(f"{DSF104}:10:7: error[DSF104]") and block[2] == "..."
    assert block[3:] == ["$ echo $?", "1"]
    assert samples.main(["--check", str(page)]) == 0


def test_an_unexpected_exit_status_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"<!-- sample: dsforge validate {DSF104} -->\n```console\n```\n", encoding="utf-8")
    assert samples.main([str(page)]) == 1
    assert "exited 1, the marker says rc=0" in capsys.readouterr().out
    assert page.read_text(encoding="utf-8").endswith("```console\n```\n")  # left as it was


def test_samples_run_in_a_scratch_view_not_the_checkout(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- sample: printf 'x\\n' > README.md -->\n<!-- sample: pwd -->\n```console\n```\n",
                    encoding="utf-8")
    before = README.read_bytes()
    assert samples.main([str(page)]) == 0
    assert README.read_bytes() == before
    # the scratch root prints as .
    assert page.read_text(encoding="utf-8").split("$ pwd\n")[1].startswith(".\n")


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- sample: dsforge presets -->\nno block here\n", "must be followed by a ```console block"),
    ("<!-- sample[size=3]: dsforge presets -->\n```console\n```\n", "unknown sample option 'size'"),
    ("<!-- sample[head=x]: dsforge presets -->\n```console\n```\n", "head= needs a number"),
    ("<!-- sample[lines=3..4]: dsforge presets -->\n```console\n```\n", "lines= takes ranges"),
    ("<!-- sample[grep=(]: dsforge presets -->\n```console\n```\n", "grep= is not a regular expression"),
    ("<!-- sample: dsforge presets -->\n```console\n$ dsforge presets\n", "never closed"),
])
def test_bad_markers_are_reported(text: str, message: str) -> None:
    with pytest.raises(samples.SampleError, match=re.escape(message)):
        samples.find_blocks(ROOT / "page.md", text.splitlines())


def test_markers_quoted_inside_another_block_are_text() -> None:
    lines = ["````markdown", "<!-- sample: dsforge presets -->", "```console", "```", "````",
             "<!-- sample: dsforge schema -->", "```console", "```"]
    blocks = samples.find_blocks(ROOT / "page.md", lines)
    assert [[c.text for c in b.commands] for b in blocks] == [["dsforge schema"]]
    assert (blocks[0].start, blocks[0].end) == (6, 7)


def test_trim_options() -> None:
    lines = [f"l{i}" for i in range(1, 11)]
    assert samples.trim(lines, {"head": "2"}) == ["l1", "l2", "..."]
    assert samples.trim(lines, {"head": "10"}) == lines
    assert samples.trim(lines, {"lines": "2-3,9-"}) == ["...", "l2", "l3", "...", "l9", "l10"]
    assert samples.trim(lines, {"grep": "l[15]$"}) == ["l1", "...", "l5", "..."]
    assert samples.trim(lines, {"from": "^l8", "head": "2"}) == ["...", "l8", "l9", "..."]
    assert samples.trim(lines, {"from": "nowhere"}) == ["..."]


@given(st.lists(st.sampled_from(["a", "b", "ab", ""]), max_size=30), st.integers(0, 40),
       st.sampled_from(["a", "b", "^$", "."]))
def test_trim_keeps_lines_in_order_and_marks_every_cut(lines: list[str], head: int, pattern: str) -> None:
    out = samples.trim(lines, {"grep": pattern, "head": str(head)})
    kept = [x for x in out if x != "..."]
    assert len(kept) <= head and all(re.search(pattern, x) for x in kept)
    it = iter(lines)
    assert all(any(x == y for y in it) for x in kept)  # a subsequence of the output
    assert "...\n..." not in "\n".join(out)  # one marker per cut
    assert (out == lines) == (len(kept) == len(lines))  # nothing cut, no marker


def test_the_two_command_blocks_stay_where_ci_reads_them() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    for marker, tail in (("<!-- main-command -->", "dsforge run examples/tiny-3d.yaml"),
                         ("<!-- test-command -->", "python -m pytest -q")):
        i = lines.index(marker)
        assert lines[i + 1] == "```bash" and lines[i + 3] == "```"
        command = lines[i + 2]  # what .ci/run's awk prints: the second line after the marker
        assert command.startswith("python3 -m venv .venv && ") and command.endswith(tail)
        assert " .venv/bin/" in command and "source " not in command and "activate" not in command


def _yaml_blocks(text: str) -> list[object]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)]


def test_the_action_and_hook_snippets_match_their_files() -> None:
    blocks = _yaml_blocks(README.read_text(encoding="utf-8"))
    action = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    steps = [b[0] for b in blocks if isinstance(b, list) and "uses" in b[0]]
    assert steps and all(set(s["with"]) <= set(action["inputs"]) for s in steps)
    repos = [b["repos"] for b in blocks if isinstance(b, dict) and "repos" in b]
    hook_ids = {h["id"] for h in hooks}
    assert repos and all(h["id"] in hook_ids for r in repos for repo in r for h in repo["hooks"])


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """The text outside code blocks and code spans (a regex in a code span is not a link)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^(```+).*?^\1", "", text, flags=re.DOTALL | re.MULTILINE))


def test_links_between_the_pages_resolve() -> None:
    pages = samples.markdown_files()
    anchors = {p.resolve(): {_slug(h) for h in re.findall(r"^#+ (.+)$", p.read_text(encoding="utf-8"),
                                                          re.MULTILINE)}
               | set(re.findall(r'<a id="([^"]+)"', p.read_text(encoding="utf-8")))
               for p in pages}
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.exists() or (anchor and dest in anchors and anchor not in anchors[dest]):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_command_checker_reads_the_readme_as_a_newcomer_would() -> None:
    steps = checker.readme_steps(README.read_text(encoding="utf-8"))
    assert steps[0].command.endswith("dsforge run examples/tiny-3d.yaml") and not steps[0].skip
    assert [s.skip for s in steps if s.command.endswith("python -m pytest -q")] == [
        "the test command (.ci/run runs it)"]
    assert [s.skip for s in steps if "lightning" in s.command] == [""]  # dsforge's strategy runs on CPUs
    ran = [s for s in steps if not s.skip]
    assert not any(s.command.startswith("echo ") for s in steps)
    assert {s.rc for s in ran if "dsf104" in s.command} == {1}
    assert all(s.rc == 0 for s in ran if s.command.startswith(("python3 ", ".venv/bin/")))
    with_tests = checker.readme_steps(README.read_text(encoding="utf-8"), with_tests=True)
    assert len([s for s in with_tests if not s.skip]) == len(ran) + 1


def test_the_checker_parses_bash_and_console_blocks() -> None:
    rows = [
        "<!-- main-command -->", "```bash", "make all", "```", "",
        "```bash", "# a comment", "first --flag \\", "  continued", "", "second", "```",
        "<!-- needs: cluster -->", "```bash", "sbatch job.sbatch", "```",
        "<!-- sample[rc=2]: dsforge validate missing.yaml -->", "```console",
        "$ dsforge validate missing.yaml", "error", "$ echo $?", "2", "```", "````markdown", "```bash",
        "quoted", "```", "````"]
    steps = checker.readme_steps("\n".join(rows))
    assert [(s.command, s.rc, s.skip) for s in steps] == [
        ("make all", 0, ""), ("first --flag    continued", 0, ""), ("second", 0, ""),
        ("sbatch job.sbatch", 0, "needs cluster"), ("dsforge validate missing.yaml", 2, "")]
    assert [s.block for s in steps] == [0, 2, 2, 3, 4]
