"""Fuzz dsforge as an adversary would: mutated job files through validate, explain and compile.

Seeds are the examples, the good fixtures and the bad corpus (each with the base files its `extends:`
names). A case applies a few mutations to a seed: numbers (huge, tiny, negative, 0, NaN, infinities,
primes near 1e12), types, keys (deleted, misspelt, unknown), YAML structure (tags, aliases, duplicate
keys, tabs, truncation, stray bytes, deep nesting), `extends:` chains (split into a base, cycles,
missing or odd names) and parallel-degree combinations. Each case is checked against the promises
of issue 13:

* no exception escapes the CLI (exit 0, 1 or 2; no "internal error", no traceback; DSF900, DSF690 and
  DSF691 are internal failures reported as diagnostics, counted as internal errors here);
* every command finishes within the per-command budget (CPU seconds) and never hangs;
* every JSON output (validate --format json, explain --format json, plan.json, ds_config.json) parses
  with a strict parser (no NaN, no Infinity);
* a job that validates clean explains and compiles (--no-rewrite) cleanly;
* a compile that refuses leaves no job directory behind, not even half of one.

    python benchmarks/fuzz.py --n 10000 [--seed 0] [--jobs N] [--timeout 20] [--budget 2] [--show 5]

prints the count of each outcome class and exits 1 when any failure class is not 0. Each case runs
in a worker process (a pool) under signal.alarm, so a hang costs the timeout, not the campaign.
tests/test_fuzz.py drives the same mutations from hypothesis for a bounded number of cases in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml

OK, FINDINGS, UNUSABLE = "ok", "findings", "unusable"
INTERNAL, HANG, SLOW = "internal error", "hang", "slow (over the per-command budget)"
LATER, NONFINITE, HALF = (
    "validate-clean but explain/compile failed",
    "non-finite JSON",
    "half-written job directory",
)
OUTCOMES = (OK, FINDINGS, UNUSABLE, INTERNAL, HANG, SLOW, LATER, NONFINITE, HALF)
FAILURES = (INTERNAL, HANG, SLOW, LATER, NONFINITE, HALF)
#: Diagnostics that report dsforge failing on a job (a crashing rule, cost model or rewrite planner).
INTERNAL_IDS = ("DSF900", "DSF690", "DSF691")


# --- seeds ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """Files to write (relative path -> bytes) and the one to run the commands on."""

    name: str
    files: dict[str, bytes]
    entry: str


def _extends_names(raw: bytes) -> list[str]:
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001 - bad fixtures are bad on purpose
        return []
    names = doc.get("extends") if isinstance(doc, dict) else None
    names = [names] if isinstance(names, str) else names
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _closure(folder: Path, entry: str) -> dict[str, bytes]:
    """``entry`` and every base file its `extends:` chain names inside ``folder``."""
    files: dict[str, bytes] = {}
    todo = [entry]
    while todo:
        rel = todo.pop()
        path = folder / rel
        try:
            if rel in files or not path.is_file() or len(files) > 20:
                continue
            files[rel] = path.read_bytes()
        except (OSError, ValueError):  # a base name no file can have (the bad corpus holds some)
            continue
        base = os.path.dirname(rel)
        todo += [
            os.path.normpath(os.path.join(base, n))
            for n in _extends_names(files[rel])
            if not os.path.isabs(n) and ".." not in os.path.normpath(os.path.join(base, n)).split(os.sep)
        ]
    return files


def seed_cases() -> list[Case]:
    """Every example, good fixture and bad fixture, each with the bases it extends."""
    cases = []
    for folder, pattern in ((ROOT / "examples", "*.yaml"), (ROOT / "tests" / "fixtures" / "good", "*.yaml"),
                            (ROOT / "tests" / "fixtures" / "bad", "*.yaml")):
        for path in sorted(folder.glob(pattern)):
            cases.append(Case(f"{folder.name}/{path.name}", _closure(folder, path.name), path.name))
    return cases


# --- mutations --------------------------------------------------------------------------------------------

PRIME_1E12 = 999_999_999_989
NUMBERS: tuple[Any, ...] = (
    0, 1, 2, 3, 4, 7, 8, 16, 64, 1000, 65537, -1, -8, 2**31, 2**40, 2**63, 10**19, PRIME_1E12, 10**100,
    10**299, 0.0, 0.5, -0.5, 1e-9, 5e-324, 1e-300, 1e300, 1e308, -1e308, math.nan, math.inf, -math.inf,
    3.0e-4, 0.999999, True, False, None,
)
STRINGS: tuple[Any, ...] = ("", "auto", "a" * 300, "x\x00y", "1e400", ".nan", "../../etc/passwd", "$(reboot)",
                            "tp-pp-dp-cp-ep", "pp-dp", "ring", "interleaved", "gpipe", "ulysses", "cpu",
                            "nvme", "llama3-8b", "tiny-mixtral", "dgx-h100", "cpu-local", "\u202e", "é" * 50,
                            "(", "[a-", ".*", "*", "/dev/zero", "/", "~", "C:\\x", "24:00:00", "1:2", "0x1F",
                            "1_000", "fp32", "bf16", "none", "full", "selective", "synthetic", "tokens",
                            "uint32")
CONTAINERS: tuple[Any, ...] = ([], {}, [1, 2], {"a": 1}, [[[]]], {"tp": 2})
VALUES = NUMBERS + STRINGS + CONTAINERS
DEGREE_KEYS = ("tp", "pp", "dp", "cp", "ep", "zero")
DEGREES: tuple[Any, ...] = (1, 2, 3, 4, 8, 16, 64, 1024, "auto", 0, 2**20, 2**20 + 1)
SECTIONS = {
    "model": ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "vocab_multiple_of",
              "preset", "arch", "moe", "tied_embeddings"),
    "model.moe": ("experts", "top_k", "every", "ffn_hidden", "capacity_factor"),
    "hardware": ("nodes", "gpus_per_node", "preset", "accelerator", "intra_node", "inter_node"),
    "hardware.accelerator": ("memory_gb", "bf16_tflops", "fp16_tflops", "fp32_tflops", "hbm_gbs",
                             "achievable_fraction", "name"),
    "hardware.intra_node": ("bandwidth_gbs", "latency_us"),
    "hardware.inter_node": ("bandwidth_gbs", "latency_us"),
    "parallel": (*DEGREE_KEYS, "sequence_parallel", "order", "pipeline", "context_parallel",
                 "replicate_kv_heads"),
    "parallel.pipeline": ("schedule", "virtual_stages", "partition"),
    "training": ("global_batch", "micro_batch", "steps", "grad_clip", "seed", "precision", "recompute"),
    "training.optimizer": ("name", "lr", "eps", "weight_decay", "offload", "betas"),
    "deepspeed": ("steps_per_print", "train_batch_size", "gradient_accumulation_steps", "zero_optimization",
                  "bf16", "fp16", "gradient_clipping"),
    "deepspeed.zero_optimization": ("reduce_bucket_size", "stage", "allgather_bucket_size", "overlap_comm",
                                    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
    "launch": ("launcher", "hosts", "master_port", "env", "python", "image", "master_addr", "partition",
               "account", "time_limit", "namespace", "rdzv_backend", "gpu_resource"),
    "training.scheduler": ("name", "warmup_steps", "min_lr"),
    "training.data": ("kind", "path", "dtype"),
    "training.checkpoint": ("dir", "every", "resume"),
    "parallel.context_parallel": ("kind",),
    "launch.env": ("NCCL_DEBUG", "PATH", "", "A B", "X\x00"),
}
TOP_KEYS = ("name", "version", "extends", "stack", "rewrite", "deepspeed", "search", "launch", "parallel")
TAGS = ("!!int", "!!float", "!!bool", "!!str", "!!null", "!!binary", "!!timestamp", "!!seq", "!!map",
        "!!python/object/apply:os.system", "!custom", "!!set", "!!omap")
TEXT_BITS = ("\t", "\x00", "\x07", "\ufeff", ": :", "{", "[", "]", "}", "&a ", "*a", "*b", "<<: *a\n", "- ",
             "? ", "|\n", ">\n", "%YAML 1.2\n", "---\n", "...\n", "#", "'", '"', "\\", "\r", "\u2028",
             "\ud800")
DOC_KINDS = ("number", "scale", "value", "degree", "section_key", "top_key", "rewrite", "delete", "rename",
             "unknown_key", "wrap", "extends_split", "extends_odd", "deep")
TEXT_KINDS = ("tag", "insert", "truncate", "duplicate_line", "bytes", "anchor_bomb", "indent")
KINDS = DOC_KINDS + TEXT_KINDS


@dataclass
class Work:
    """A case being mutated: its files (entry parsed as data when it parses) and the entry name."""

    files: dict[str, bytes]
    entry: str
    doc: Any = None
    text_ops: list[tuple[str, int, int]] = field(default_factory=list)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path in a parsed document (mappings and list items), depth-first."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    node = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _section(doc: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = doc
    for part in dotted.split("."):
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    return node


def _doc_op(work: Work, kind: str, where: int, pick: int) -> None:
    doc = work.doc
    paths = list(_paths(doc))
    if kind == "number" and paths:
        _set(doc, paths[where % len(paths)], NUMBERS[pick % len(NUMBERS)])
    elif kind == "value" and paths:
        _set(doc, paths[where % len(paths)], VALUES[pick % len(VALUES)])
    elif kind == "scale" and paths:  # a number grown or shrunk but kept in type: valid jobs that are huge
        path = paths[where % len(paths)]
        node = doc
        for part in path:
            node = node[part]
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            factor = (2, 3, 8, 1000, 2**20, 2**30, 2**40)[pick % 7]
            _set(doc, path,
                 node * factor if pick % 3 else (node / factor if isinstance(node, float) else node + 1))
    elif kind == "degree":
        _section(doc, "parallel")[DEGREE_KEYS[where % len(DEGREE_KEYS)]] = DEGREES[pick % len(DEGREES)]
    elif kind == "section_key":
        names = sorted(SECTIONS)
        dotted = names[where % len(names)]
        keys = SECTIONS[dotted]
        _section(doc, dotted)[keys[pick % len(keys)]] = VALUES[(where // len(names) + pick) % len(VALUES)]
    elif kind in ("delete", "rename") and paths:
        path = paths[where % len(paths)]
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        if isinstance(parent, dict):
            value = parent.pop(path[-1])
            if kind == "rename":
                key = str(path[-1])
                parent[key[:-1] + key[-1:].upper() if pick % 2 else key + "s"] = value
    elif kind == "top_key":
        doc[TOP_KEYS[where % len(TOP_KEYS)]] = VALUES[pick % len(VALUES)]
    elif kind == "rewrite":
        rules = doc.setdefault("rewrite", []) if isinstance(doc.get("rewrite"), list) else []
        doc["rewrite"] = rules
        rules.append({"match": STRINGS[where % len(STRINGS)],
                      "as": ("column", "row", "vocab", "norm", "expert",
                      "bogus")[pick % 6], "fused": NUMBERS[(where + pick) % len(NUMBERS)]})
    elif kind == "unknown_key":
        names = sorted(SECTIONS)
        _section(doc, names[where % len(names)])[f"unknown_{pick % 7}"] = VALUES[pick % len(VALUES)]
    elif kind == "wrap" and paths:  # a scalar becomes a list or a mapping of itself, or the reverse
        path = paths[where % len(paths)]
        node = doc
        for part in path:
            node = node[part]
        _set(doc, path, [node] if pick % 3 == 0 else {"value": node} if pick % 3 == 1 else str(node))
    elif kind == "extends_split":  # move some sections into a base file the entry extends
        base = f"base_{pick % 3}.yaml"
        moved = {k: doc.pop(k) for k in list(doc)[where % 3::2] if k != "extends"}
        if pick % 5 == 0:
            moved["extends"] = work.entry  # a cycle back to the entry
        work.files[base] = yaml.safe_dump(moved, sort_keys=False).encode("utf-8")
        doc["extends"] = base if pick % 2 else [base]
    elif kind == "extends_odd":
        odd: tuple[Any, ...] = ("missing.yaml", ".", "/dev/zero", "/dev/null", "a\x00b.yaml",
                                "b" * 300 + ".yaml", "c/" * 2100, [], [""], 7, "/", "..", work.entry)
        doc["extends"] = odd[pick % len(odd)]
    elif kind == "deep":
        node: Any = VALUES[pick % len(VALUES)]
        for _ in range(where % 90):
            node = [node] if pick % 2 else {"k": node}
        _section(doc, "deepspeed")["deep"] = node


def _text_op(text: str, kind: str, where: int, pick: int) -> str:
    lines = text.split("\n")
    i = where % max(1, len(lines))
    if kind == "tag":
        row = lines[i]
        if ":" in row and not row.lstrip().startswith("#"):
            key, _, value = row.partition(":")
            lines[i] = f"{key}: {TAGS[pick % len(TAGS)]} {value.strip()}"
    elif kind == "insert":
        row = lines[i]
        at = pick % (len(row) + 1)
        lines[i] = row[:at] + TEXT_BITS[(where // 7 + pick) % len(TEXT_BITS)] + row[at:]
    elif kind == "truncate":
        return text[: where % (len(text) + 1)]
    elif kind == "duplicate_line":
        lines.insert(i, lines[i])
    elif kind == "indent":
        lines[i] = " " * (pick % 5) + lines[i]
    elif kind == "anchor_bomb":
        depth = 3 + pick % 8
        bomb = ["bomb0: &b0 [x, x, x, x, x, x, x, x, x]"]
        bomb += [f"bomb{n}: &b{n} [{', '.join(f'*b{n - 1}' for _ in range(9))}]" for n in range(1, depth)]
        lines = bomb + lines
    return "\n".join(lines)


def mutate(case: Case, ops: list[tuple[str, int, int]]) -> dict[str, bytes]:
    """The case's files with ``ops`` (kind, where, pick) applied; text-level ops after the data-level ones."""
    work = Work(dict(case.files), case.entry)
    raw = case.files[case.entry]
    try:  # aliases may expand exponentially (the corpus's billion laughs): such seeds get text mutations only
        work.doc = None if b"&" in raw and b"*" in raw else yaml.safe_load(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001 - a seed that is bad YAML gets text mutations only
        work.doc = None
    doc_ops = [op for op in ops if op[0] in DOC_KINDS]
    text = case.files[case.entry].decode("utf-8", "surrogateescape")
    if isinstance(work.doc, dict) and doc_ops:
        try:
            for kind, where, pick in doc_ops:
                _doc_op(work, kind, where, pick)
            text = yaml.safe_dump(work.doc, sort_keys=False, allow_unicode=True, width=4096)
        except RecursionError:  # a seed whose aliases make a recursive structure: its text is mutated instead
            work.files = dict(case.files)
    for kind, where, pick in (op for op in ops if op[0] in TEXT_KINDS):
        text = _text_op(text, kind, where, pick)
    try:
        raw = text.encode("utf-8", "surrogateescape")  # a seed's own invalid bytes come back as they were
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")  # an inserted lone surrogate: bytes no UTF-8 reader takes
    bytes_ops = [op for op in ops if op[0] == "bytes"]
    for _, where, pick in bytes_ops:  # stray bytes that are not UTF-8, or a NUL
        at = where % (len(raw) + 1)
        raw = raw[:at] + bytes([(0x80, 0xFF, 0x00, 0xC3, 0xE2)[pick % 5]]) + raw[at:]
    work.files[case.entry] = raw
    return work.files


def random_ops(rng: random.Random) -> list[tuple[str, int, int]]:
    """One to four mutations (one in 40 % of cases), data-level ones more often than text-level ones."""
    # scaled numbers and degrees keep jobs usable
    kinds = DOC_KINDS * 3 + TEXT_KINDS + ("scale", "degree") * 4
    count = 1 if rng.random() < 0.4 else rng.randint(2, 4)
    return [(rng.choice(kinds), rng.randrange(10**6), rng.randrange(10**6)) for _ in range(count)]


# --- the oracle -------------------------------------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON number {name}")


def strict_json(text: str) -> Any:
    """Parse JSON as strict readers do: NaN and Infinity are errors."""
    return json.loads(text, parse_constant=_reject_constant)


class Timeout(BaseException):
    """The per-case alarm went off (a BaseException: the rule runner's `except Exception` must not catch
    it)."""


@dataclass
class Outcome:
    """A case's outcome class, what showed it, and each command's CPU seconds."""

    kind: str
    detail: str = ""
    seconds: dict[str, float] = field(default_factory=dict)


def _invoke(args: list[str], cwd: Path) -> tuple[int, str, str, BaseException | None, float]:
    from click.testing import CliRunner

    from dsforge.cli import cli

    runner = CliRunner()
    began = time.process_time()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        result = runner.invoke(cli, args, catch_exceptions=True)
    finally:
        os.chdir(old)
    spent = time.process_time() - began
    exc = result.exception
    if isinstance(exc, Timeout):
        raise exc
    return result.exit_code, result.stdout, result.stderr, None if isinstance(exc, SystemExit) else exc, spent


def _broken(code: int, out: str, err: str, exc: BaseException | None) -> str | None:
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"[:300]
    if code not in (0, 1, 2):
        return f"exit code {code}"
    if "internal error" in err or "Traceback" in err or "Traceback" in out:
        return err.strip()[-300:]
    return None


def check_files(files: dict[str, bytes], entry: str, workdir: Path, budget: float = 2.0,
                compile_failures: bool = True) -> Outcome:
    """Write ``files`` into ``workdir`` and hold validate, explain and compile to their promises."""
    for rel, raw in files.items():
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    seconds: dict[str, float] = {}

    def run(verb: str, *args: str) -> tuple[int, str, str] | Outcome:
        code, out, err, exc, spent = _invoke([verb, *args], workdir)
        seconds[verb] = spent
        problem = _broken(code, out, err, exc)
        if problem is not None:
            return Outcome(INTERNAL, f"{verb}: {problem}", seconds)
        if spent > budget:
            return Outcome(SLOW, f"{verb}: {spent:.2f} s of CPU", seconds)
        return code, out, err

    got = run("validate", entry, "--format", "json")
    if isinstance(got, Outcome):
        return got
    code, out, _ = got
    try:
        report = strict_json(out)
    except ValueError as exc:
        return Outcome(NONFINITE, f"validate --format json: {exc}", seconds)
    rules = {d["rule"] for d in report["diagnostics"]}
    if rules & set(INTERNAL_IDS):
        return Outcome(INTERNAL, f"validate reports {sorted(rules & set(INTERNAL_IDS))}", seconds)
    target = workdir / "out"
    if code != 0:
        if compile_failures and code == 1:
            got = run("compile", entry, "-o", str(target), "--no-rewrite")
            if isinstance(got, Outcome):
                return got
            if got[0] == 0:
                return Outcome(LATER, "validate found errors but compile wrote the job", seconds)
            if target.exists():
                return Outcome(HALF, f"compile refused (exit {got[0]}) but left {target.name}/", seconds)
        return Outcome(FINDINGS if code == 1 else UNUSABLE, "", seconds)
    got = run("explain", entry, "--format", "json")
    if isinstance(got, Outcome):
        return got
    if got[0] != 0:
        return Outcome(LATER, f"explain exit {got[0]}: {got[2].strip()[-300:]}", seconds)
    try:
        summary = strict_json(got[1])
    except ValueError as exc:
        return Outcome(NONFINITE, f"explain --format json: {exc}", seconds)
    got = run("compile", entry, "-o", str(target), "--no-rewrite")
    if isinstance(got, Outcome):
        return got
    if got[0] != 0:
        return Outcome(LATER, f"compile exit {got[0]}: {(got[1] + got[2]).strip()[-300:]}", seconds)
    for name in ("plan.json", "ds_config.json"):
        try:
            strict_json((target / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return Outcome(NONFINITE if isinstance(exc, ValueError) else HALF, f"{name}: {exc}", seconds)
    del summary
    return Outcome(OK, "", seconds)


# --- the campaign -----------------------------------------------------------------------------------------

def _alarm(signum: int, frame: Any) -> None:
    raise Timeout()


def run_one(task: tuple[int, int, float, float]) -> tuple[int, str, str, str]:
    """One case of the campaign (in a worker): (index, outcome, case description, detail)."""
    index, seed, timeout, budget = task
    rng = random.Random(seed * 1_000_003 + index)
    cases = _seeds()
    # half the cases start from a job that validates (examples, good fixtures), half from the bad corpus
    usable = [c for c in cases if not c.name.startswith("bad/")]
    case = rng.choice(usable if rng.random() < 0.5 else cases)
    ops = random_ops(rng)
    described = f"{case.name} {ops}"
    workdir = Path(tempfile.mkdtemp(prefix="dsforge-fuzz-"))
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        outcome = check_files(mutate(case, ops), case.entry, workdir, budget)
    except Timeout:
        outcome = Outcome(HANG, f"over {timeout} s")
    except Exception as exc:  # noqa: BLE001 - the oracle itself must not stop the campaign
        outcome = Outcome(INTERNAL, f"{type(exc).__name__}: {exc}"[:300])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        shutil.rmtree(workdir, ignore_errors=True)
    return index, outcome.kind, described, outcome.detail


_SEEDS: list[Case] = []


def _seeds() -> list[Case]:
    if not _SEEDS:
        _SEEDS.extend(seed_cases())
    return _SEEDS


def _warm() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _seeds()
    from dsforge.cli import cli  # noqa: F401  imports paid once per worker, not by the first case's budget
    from dsforge.compiler.rules import load_builtin

    load_builtin()


def main(argv: list[str] | None = None) -> int:
    """Run the campaign and print the outcome counts; exit 1 when a failure class is not empty."""
    import multiprocessing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="cases to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a case counts as a hang")
    parser.add_argument("--budget", type=float, default=2.0, help="CPU seconds one command may take")
    parser.add_argument("--show", type=int, default=5, help="examples printed per failure class")
    args = parser.parse_args(argv)
    began = time.time()
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    tasks = [(i, args.seed, args.timeout, args.budget) for i in range(args.n)]
    with multiprocessing.get_context("fork").Pool(args.jobs, initializer=_warm) as pool:
        for done, (index, kind, described,
                   detail) in enumerate(pool.imap_unordered(run_one, tasks, chunksize=4), 1):
            counts[kind] += 1
            if kind in FAILURES and len(examples.setdefault(kind, [])) < args.show:
                examples[kind].append(f"#{index} {described}: {detail}")
            if done % 1000 == 0:
                print(f"  {done}/{args.n} cases, {time.time() - began:.0f} s", file=sys.stderr, flush=True)
    print(f"dsforge fuzz campaign: {args.n} cases (seed {args.seed}, {len(_seeds())} seed files, "
          f"{args.timeout:g} s timeout, {args.budget:g} CPU s per command) in {time.time() - began:.0f} s")
    for kind in OUTCOMES:
        print(f"  {kind:<45} {counts[kind]:>6}")
    for kind, shown in examples.items():
        print(f"{kind}:")
        for line in shown:
            print(f"  {line}")
    return 1 if any(counts[k] for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
