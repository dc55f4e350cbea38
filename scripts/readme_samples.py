"""Regenerate (or check) the console samples of README.md and docs/*.md from dsforge's real output.

A sample is a ```console block preceded by one or more marker comments, each naming a command:

    <!-- sample: dsforge validate tests/fixtures/bad/dsf104-tp-kv-heads.yaml -->
    <!-- sample[lines=1-12,30- rc=1]: dsforge explain examples/llama3-70b-multinode.yaml -->

The commands of one block run in order, each in a bash shell, from a fresh scratch view of the
repository root (so a sample may write `out/...` or `dsforge.toml` without touching the checkout);
`dsforge` there is this interpreter's (`sys.executable -m dsforge`). The block becomes, per command,
`$ COMMAND` and its output (stdout and stderr as a terminal interleaves them), then `$ echo $?` and the
exit status when it is not 0. Paths under the scratch view or the checkout print repo-relative, and this
interpreter prints as `.venv/bin/python` (where the README installs it), so the text is the same on
every machine.

Options, in brackets before the colon, separated by blanks:

    head=N          keep the first N output lines
    lines=A-B,C-    keep these output lines (1-based, inclusive; `C-` runs to the end)
    from=REGEX      keep the lines from the first one that matches on
    grep=REGEX      keep the output lines that match (no blanks or `]`; write \\s for a blank)
    rc=N            the exit status the command must have (default 0); another one is an error
    slow            only run with --slow (torch, training); otherwise the block is left as it is
    needs=WHAT      (for scripts/check_readme_commands.py: cluster, gpu; never run there)

Filters apply in that order (lines, from, grep, then head); every cut shows as a `...` line.

    python scripts/readme_samples.py            # rewrite the stale samples
    python scripts/readme_samples.py --check    # exit 1 and print a diff when a sample is stale
    python scripts/readme_samples.py --slow     # also the slow ones (a real `dsforge run`: minutes)
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- sample(?:\[(?P<opts>[^\]]*)\])?: (?P<cmd>.+?) -->\s*$")
FENCE = "```"
OPTIONS = ("head", "lines", "from", "grep", "rc", "slow", "needs")
#: Checkout paths a sample never needs; the package comes from the interpreter, not from a copy.
NOT_COPIED = ("dsforge/", ".git/", ".venv/")
TIMEOUT_S = 120
SLOW_TIMEOUT_S = 1800


class SampleError(Exception):
    """A marker that cannot be used, or a command that failed differently than its marker says."""


@dataclass
class Command:
    """One marker: the command line and its options."""

    text: str
    options: dict[str, str]
    where: str

    @property
    def rc(self) -> int:
        """The exit status the marker expects."""
        return int(self.options.get("rc", "0"))

    @property
    def slow(self) -> bool:
        """Whether it runs only with --slow."""
        return "slow" in self.options


@dataclass
class Block:
    """A console block and the markers above it; ``start``/``end`` index its fence lines."""

    path: Path
    commands: list[Command]
    start: int
    end: int
    old: list[str] = field(default_factory=list)

    @property
    def slow(self) -> bool:
        """A block with one slow command is regenerated only with --slow."""
        return any(c.slow for c in self.commands)


def parse_options(raw: str | None, where: str) -> dict[str, str]:
    """The options of a marker, checked against the known names."""
    out: dict[str, str] = {}
    for token in (raw or "").split():
        key, _, value = token.partition("=")
        if key not in OPTIONS:
            raise SampleError(f"{where}: unknown sample option {key!r} (known: {', '.join(OPTIONS)})")
        if key in ("head", "rc") and not value.isdigit():
            raise SampleError(f"{where}: {key}= needs a number, got {value!r}")
        if key == "lines" and not re.fullmatch(r"\d+(-\d*)?(,\d+(-\d*)?)*", value):
            raise SampleError(f"{where}: lines= takes ranges like 1-12,30-, got {value!r}")
        if key in ("grep", "from"):
            try:
                re.compile(value)
            except re.error as exc:
                raise SampleError(f"{where}: {key}= is not a regular expression: {exc}") from None
        out[key] = value
    return out


def _past_fence(lines: list[str], i: int) -> int:
    """The index after the fenced block opening at line ``i`` (markers quoted inside a block are text)."""
    fence = re.match(r"`+", lines[i].lstrip())
    assert fence is not None
    ticks = fence.group(0)
    for j in range(i + 1, len(lines)):
        if re.fullmatch(ticks + "`*", lines[j].strip()):
            return j + 1
    return len(lines)


def find_blocks(path: Path, lines: list[str]) -> list[Block]:
    """Every marked console block of one Markdown file."""
    blocks: list[Block] = []
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    i = 0
    while i < len(lines):
        commands: list[Command] = []
        while i < len(lines) and (m := MARKER.match(lines[i])):
            where = f"{rel}:{i + 1}"
            commands.append(Command(m["cmd"], parse_options(m["opts"], where), where))
            i += 1
        if not commands:
            i = _past_fence(lines, i) if lines[i].lstrip().startswith(FENCE) else i + 1
            continue
        if i >= len(lines) or lines[i].strip() != FENCE + "console":
            raise SampleError(f"{commands[-1].where}: a sample marker must be followed by a ```console block")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == FENCE), None)
        if end is None:
            raise SampleError(f"{rel}:{i + 1}: the console block is never closed")
        blocks.append(Block(path, commands, i, end, lines[i + 1:end]))
        i = end + 1
    return blocks


def _ranges(spec: str, n: int) -> set[int]:
    keep: set[int] = set()
    for part in spec.split(","):
        a, dash, b = part.partition("-")
        first = int(a)
        last = (int(b) if b else n) if dash else first
        keep.update(range(first - 1, min(last, n)))
    return keep


def trim(lines: list[str], options: dict[str, str]) -> list[str]:
    """The output lines the options keep, with `...` where lines were cut."""
    keep = list(range(len(lines)))
    if "lines" in options:
        chosen = _ranges(options["lines"], len(lines))
        keep = [i for i in keep if i in chosen]
    if "from" in options:
        start = re.compile(options["from"])
        first = next((i for i in keep if start.search(lines[i])), len(lines))
        keep = [i for i in keep if i >= first]
    if "grep" in options:
        pattern = re.compile(options["grep"])
        keep = [i for i in keep if pattern.search(lines[i])]
    if "head" in options:
        keep = keep[: int(options["head"])]
    out: list[str] = []
    previous = -1
    for i in keep:
        if i != previous + 1:
            out.append("...")
        out.append(lines[i])
        previous = i
    if previous != len(lines) - 1:
        out.append("...")
    return out


class Scratch:
    """A copy of the checkout's files and, per block, a fresh directory viewing it (links to its top
    level)."""

    def __init__(self) -> None:
        self.top = Path(tempfile.mkdtemp(prefix="dsforge-samples-"))
        self.base = self.top / "repo"
        self.bin = self.top / "bin"
        self.count = 0
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
        for rel in filter(None, listed):
            src = ROOT / rel
            if rel.startswith(NOT_COPIED) or not src.is_file():
                continue
            dst = self.base / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        self.bin.mkdir()
        shim = self.bin / "dsforge"
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dsforge \"$@\"\n",
                        encoding="utf-8")
        shim.chmod(0o755)

    def view(self) -> Path:
        """A new directory whose entries link to the copied checkout's top level."""
        self.count += 1
        d = self.top / f"block{self.count:03d}"
        d.mkdir()
        for entry in self.base.iterdir():
            (d / entry.name).symlink_to(entry)
        return d

    def close(self) -> None:
        """Remove every scratch file."""
        shutil.rmtree(self.top, ignore_errors=True)


def _environment(scratch: Scratch) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSFORGE_", "PYTHON"))}
    env.update(PATH=f"{scratch.bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}", PYTHONUNBUFFERED="1",
               COLUMNS="100", LC_ALL="C.UTF-8", TERM="dumb", NO_COLOR="1", DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _normalise(text: str, scratch: Scratch, cwd: Path) -> str:
    text = text.replace(sys.executable, ".venv/bin/python")
    for prefix in {str(cwd), str(cwd.resolve()), str(scratch.base), str(scratch.base.resolve()), str(ROOT)}:
        text = text.replace(prefix + "/", "").replace(prefix, ".")
    return text


def render(block: Block, scratch: Scratch) -> list[str]:
    """The block's new lines: each command's prompt, its trimmed output and a non-zero exit status."""
    cwd = scratch.view()
    env = _environment(scratch)
    out: list[str] = []
    for c in block.commands:
        limit = SLOW_TIMEOUT_S if c.slow else TIMEOUT_S
        try:
            done = subprocess.run(["bash", "-c", c.text], check=False, cwd=cwd, env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=limit)
        except subprocess.TimeoutExpired:
            raise SampleError(f"{c.where}: `{c.text}` ran past {limit} s") from None
        text = _normalise(done.stdout.decode("utf-8", errors="replace"), scratch, cwd)
        lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        if done.returncode != c.rc:
            tail = "\n    ".join(lines[-15:])
            raise SampleError(f"{c.where}: `{c.text}` exited {done.returncode}, the marker says rc={c.rc}:"
                              f"\n    {tail}")
        out.append(f"$ {c.text}")
        out += trim(lines, c.options) if {"head", "lines", "from", "grep"} & c.options.keys() else lines
        if done.returncode:
            out += ["$ echo $?", str(done.returncode)]
    return out


def markdown_files() -> list[Path]:
    """README.md and the hand-written pages of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check compare) every sample; 1 when one is stale or fails."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff when stale")
    p.add_argument("--slow", action="store_true", help="also run the samples marked slow")
    p.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md, docs/*.md)")
    a = p.parse_args(argv)
    files = [f.resolve() for f in a.files] or markdown_files()
    scratch = Scratch()
    stale = failed = 0
    try:
        for path in files:
            lines = path.read_text(encoding="utf-8").splitlines()
            try:
                blocks = find_blocks(path, lines)
            except SampleError as exc:
                print(f"error: {exc}")
                failed += 1
                continue
            changed = False
            for block in reversed(blocks):  # from the end, so earlier indices stay valid
                if block.slow and not a.slow:
                    continue
                try:
                    new = render(block, scratch)
                except SampleError as exc:
                    print(f"error: {exc}")
                    failed += 1
                    continue
                if new != block.old:
                    stale += 1
                    changed = True
                    where = block.commands[0].where
                    if a.check:
                        sys.stdout.writelines(difflib.unified_diff(
                            [x + "\n" for x in block.old], [x + "\n" for x in new],
                            f"{where} (in the file)", f"{where} (real output)"))
                    lines[block.start + 1:block.end] = new
            if changed and not a.check:
                path.write_text("\n".join(lines) + "\n", encoding="utf-8")
                print(f"updated {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    finally:
        scratch.close()
    if a.check and stale:
        print(f"{stale} sample(s) are stale: run `python scripts/readme_samples.py` and commit")
    return 1 if failed or (a.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
