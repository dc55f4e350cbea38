#!/usr/bin/env python3
"""Run every command README.md shows, the way a newcomer would: in a fresh clone, with no virtualenv on PATH.

    python3 scripts/check_readme_commands.py              # clone HEAD into a temporary directory and run
    python3 scripts/check_readme_commands.py --worktree   # the working tree's files instead of HEAD
    python3 scripts/check_readme_commands.py --list       # only print the commands it would run

It runs the README's main command first (it creates `.venv`, installs torch and dsforge, and trains the tiny
job: minutes), then every other command of a fenced `bash` block (one a line) or `console` block (the
`$ ` lines; a `$ echo $?` line shows the status of the line before it and is not run), in README order,
each block from the clone's root with a clean tree (files a block wrote are removed before the next one;
`.venv` and `runs/` stay, as they would for a reader). As the README says, `dsforge` stands for
`.venv/bin/dsforge`. A command passes when it exits 0, or with the status its sample marker gives
(`<!-- sample[rc=1]: ... -->`). A block under `<!-- needs: gpu -->` or `<!-- needs: cluster -->` (or a
sample marker with `needs=`) is skipped. The test command is skipped unless --with-tests (.ci/run runs it).
Prints PASS, FAIL or SKIP per command and exits 1 when one failed. Needs only Python's standard library
and git; run it with the system python3.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = "```"
MARKER = re.compile(r"^<!-- sample(?:\[(?P<opts>[^\]]*)\])?: (?P<cmd>.+?) -->\s*$")
NEEDS = re.compile(r"^<!-- needs: (?P<what>[\w, -]+) -->\s*$")
#: PATH without any virtualenv: what a fresh shell on a CI runner or a workstation has.
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
#: What a reader keeps between the README's sections: the environment and the runs it trained.
KEPT = (".venv", "runs", "*.egg-info", "build")
TIMEOUT_S = 1800


@dataclass
class Step:
    """One command of the README, where it was, and what it must exit with (None: skip it, ``skip`` says
    why)."""

    command: str
    line: int
    block: int
    rc: int = 0
    skip: str = ""


def _options(raw: str | None) -> dict[str, str]:
    return dict(token.partition("=")[::2] for token in (raw or "").split())


def _bash_lines(body: list[str]) -> list[tuple[int, str]]:
    """The commands of a bash block: one a line, `\\` continuing a line, comments and blanks left out."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in enumerate(body):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def readme_steps(text: str, with_tests: bool = False) -> list[Step]:
    """Every command of the README in order, the main command first."""
    lines = text.splitlines()
    steps: list[Step] = []
    main: Step | None = None
    markers: list[tuple[str, dict[str, str]]] = []
    needs = ""
    label = ""
    block = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := MARKER.match(line):
            markers.append((m["cmd"], _options(m["opts"])))
            i += 1
            continue
        if m := NEEDS.match(line):
            needs = m["what"]
            i += 1
            continue
        if line.strip() in ("<!-- main-command -->", "<!-- test-command -->"):
            label = line.strip()
            i += 1
            continue
        fence = re.match(r"`{3,}", line.lstrip())
        if fence is None:
            if line.strip():
                markers, needs, label = [], "", ""
            i += 1
            continue
        ticks, lang = fence.group(0), line.strip()[len(fence.group(0)):].strip()
        end = next((j for j in range(i + 1, len(lines)) if re.fullmatch(ticks + "`*", lines[j].strip())),
                   len(lines))
        body = lines[i + 1:end]
        block += 1
        if lang == "bash":
            for offset, command in _bash_lines(body):
                step = Step(command, i + 2 + offset, block, skip=f"needs {needs}" if needs else "")
                if label == "<!-- main-command -->":
                    main = step
                elif label == "<!-- test-command -->":
                    step.skip = step.skip or ("" if with_tests else "the test command (.ci/run runs it)")
                    steps.append(step)
                else:
                    steps.append(step)
        elif lang == "console":
            by_command = {cmd: opts for cmd, opts in markers}
            for offset, row in enumerate(body):
                if not row.startswith("$ ") or row == "$ echo $?":
                    continue
                command = row[2:]
                opts = by_command.get(command, {})
                what = opts.get("needs", needs)
                steps.append(Step(command, i + 2 + offset, block, int(opts.get("rc", "0") or 0),
                                  f"needs {what}" if what else ""))
        markers, needs, label = [], "", ""
        i = end + 1
    if main is None:
        raise SystemExit("README.md has no <!-- main-command --> block")
    main.block = 0
    return [main, *steps]


def _checkout(dest: Path, worktree: bool) -> None:
    if not worktree:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
        return
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git = ["git", "-c", "user.name=check", "-c", "user.email=check@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "working tree"], cwd=dest, check=True)


def _environment(home: Path) -> dict[str, str]:
    keep = ("HOME", "USER", "LANG", "LC_ALL", "TERM", "TMPDIR", "PIP_", "SSL_CERT", "REQUESTS_CA_BUNDLE")
    env = {k: v for k, v in os.environ.items() if k.startswith(keep)}
    env["PATH"] = CLEAN_PATH
    env.setdefault("HOME", str(home))
    return env


def _run(step: Step, repo: Path, env: dict[str, str], log: Path) -> tuple[int, float]:
    # `dsforge` is the README's shorthand for .venv/bin/dsforge; a function keeps everything else on PATH as
    # is.
    script = f'dsforge() {{ {repo}/.venv/bin/dsforge "$@"; }}\n{step.command}\n'
    start = time.monotonic()
    with log.open("wb") as out:
        try:
            rc = subprocess.run(["bash", "-c", script], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def _clean(repo: Path) -> list[str]:
    """Remove what the last block wrote; put back (and name) tracked files it changed, which it should not."""
    subprocess.run(["git", "clean", "-fdxq", *[f"-e{k}" for k in KEPT]], cwd=repo, check=True)
    changed = subprocess.run(["git", "diff", "--name-only", "-z"], cwd=repo, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, changed):
        original = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=repo, capture_output=True,
                                  check=True).stdout
        (repo / rel).write_bytes(original)
    return [c for c in changed if c]


def main(argv: list[str] | None = None) -> int:
    """Run the README's commands in a fresh checkout; 1 when one of them failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worktree", action="store_true", help="copy the working tree (uncommitted files too)")
    p.add_argument("--with-tests", action="store_true", help="also run the test command (the whole suite)")
    p.add_argument("--keep", action="store_true", help="keep the temporary checkout and the logs")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    a = p.parse_args(argv)
    steps = readme_steps((ROOT / "README.md").read_text(encoding="utf-8"), a.with_tests)
    if a.list:
        for s in steps:
            print(f"README.md:{s.line}: {'SKIP (' + s.skip + ') ' if s.skip else ''}rc={s.rc}: {s.command}")
        return 0
    top = Path(tempfile.mkdtemp(prefix="dsforge-readme-"))
    repo, logs = top / "dsforge", top / "logs"
    logs.mkdir()
    repo.mkdir()
    _checkout(repo, a.worktree)
    env = _environment(top)
    print(f"checkout: {repo} ({'working tree' if a.worktree else 'clone of HEAD'}); PATH={CLEAN_PATH}")
    failed, block = 0, 0
    try:
        for n, s in enumerate(steps):
            if s.skip:
                print(f"SKIP  README.md:{s.line}  {s.command}  ({s.skip})")
                continue
            if s.block != block:
                touched = _clean(repo)
                if touched:
                    print(f"note: the previous block changed tracked files (restored): {', '.join(touched)}")
                block = s.block
            log = logs / f"{n:02d}.log"
            rc, took = _run(s, repo, env, log)
            ok = rc == s.rc
            failed += not ok
            want = "" if ok else f", expected {s.rc}"
            print(f"{'PASS' if ok else 'FAIL'}  README.md:{s.line}  "
                  f"{s.command}  (exit {rc}{want}, {took:.0f} s)",
                  flush=True)
            if not ok:
                tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
                print("\n".join("      | " + t for t in tail))
    finally:
        if a.keep:
            print(f"kept {top}")
        else:
            shutil.rmtree(top, ignore_errors=True)
    ran = sum(1 for s in steps if not s.skip)
    print(f"{ran - failed} of {ran} commands passed, {len(steps) - ran} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
