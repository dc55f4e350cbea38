#!/usr/bin/env python3
"""Run the shortest multi-rank job many times and count the runs that fail at exit.

The job is tiny-gpt2 on 2 CPU ranks (gloo, data parallel 2, ZeRO-1) for ``--steps`` optimizer steps
(default 2, so the background loss reduction and a checkpoint both happen). It is compiled once;
each run starts the job directory's own launcher (``launch.sh``: torchrun --standalone, what
`dsforge run` starts) from scratch (checkpoints removed, ``resume: never``). A run is counted as

* ``ok``: exit 0 and every rank printed its final line;
* ``abort``: a rank died of SIGABRT (``terminate called ...``, torchrun's ``Signal 6``): the exit-time
  abort this benchmark exists to count;
* ``failed``: any other non-zero exit (its output's tail is printed);
* ``hang``: trained (rank 0 printed its final line) but did not exit within ``--timeout`` seconds;
* ``timeout``: did not even finish training within ``--timeout`` seconds.

Each run's line also shows its exit time: from rank 0's final line (after the memory report) to
the launcher's exit: the teardown, the interpreter's exit and torchrun's own shutdown.

``--trainer hf`` / ``--trainer accelerate`` run the user-style example script of that trainer plugin instead
(examples/trainers/<trainer>, tiny Llama, ZeRO-2, 2 CPU ranks under torchrun), whose script calls no dsforge
teardown: the plugin owns the clean exit; a run has trained when rank 0 printed the trainer's last line.

Run: ``python benchmarks/exit_stress.py [--n 30] [--steps 2] [--timeout 600] [--trainer
hf|accelerate|lightning [--job job_tp.yaml]]`` (needs the runtime extra; the trainers also the trainers
extra). Exit code: 0 when every run was ``ok``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = """version: 1
name: exit-stress
model: {{preset: tiny-gpt2}}
hardware: {{preset: cpu-local, gpus_per_node: 2}}
parallel: {{dp: auto, zero: 1}}
training:
  global_batch: 4
  micro_batch: 1
  precision: fp32
  steps: {steps}
  optimizer: {{name: adamw, lr: 1.0e-3}}
  scheduler: {{name: constant}}
  checkpoint: {{resume: never}}
"""

ABORT_MARKS = ("terminate called", "Signal 6 (SIGABRT)", "SIGABRT", "exitcode  : -6")


def compile_job(tmp: Path, steps: int) -> Path:
    """The benchmark job compiled into ``tmp/job`` (no rewrite plan: it is not needed to run)."""
    from dsforge.commands.compile import compile_file

    path = tmp / "exit-stress.yaml"
    path.write_text(JOB.format(steps=steps), encoding="utf-8")
    result = compile_file(path, tmp / "job", rewrite=False)
    if result.written is None:
        raise SystemExit(f"the benchmark job does not compile: {[d.message for d in result.diagnostics]}")
    return result.written


#: What rank 0 prints once training is over, per --trainer (dsforge's runtime: its final line).
DONE = {"runtime": "final loss", "hf": "'train_runtime'", "accelerate": "optimizer steps, last loss",
        "lightning": "`Trainer.fit` stopped"}


def trainer_command(trainer: str, tmp: Path, job: str = "job.yaml") -> list[str]:
    """torchrun on the example script of a trainer plugin, 2 CPU ranks (``job``: the example's job file)."""
    example = ROOT / "examples" / "trainers" / trainer
    script = example / {"hf": "train_hf.py", "accelerate": "train_accelerate.py",
                        "lightning": "train_lightning.py"}[trainer]
    extra = ["--output-dir", str(tmp / "hf-out")] if trainer == "hf" else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(script), str(example / job), *extra]


def classify(code: int | None, output: str, done: str = DONE["runtime"]) -> str:
    """ok / abort / failed / hang / timeout for one run's exit code (None: timed out) and its output."""
    trained = done in output
    if code is None:
        return "hang" if trained else "timeout"
    if any(mark in output for mark in ABORT_MARKS):
        return "abort"
    if code == 0 and trained:
        return "ok"
    return "failed"


def run_once(job_dir: Path, timeout: float, command: list[str] | None = None, done: str = DONE["runtime"]
             ) -> tuple[str, float, float | None, str]:
    """One run of the job directory's launcher (or ``command``) from scratch.

    (outcome, seconds, seconds from rank 0's final line to the launcher's exit or None, output).
    """
    shutil.rmtree(job_dir / "checkpoints", ignore_errors=True)
    for name in ("train_log.jsonl", "memory_report.json"):
        (job_dir / name).unlink(missing_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    # A new session, so a run that hangs can be killed with every rank it started.
    proc = subprocess.Popen(command or ["bash", str(job_dir / "launch.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    end = time.perf_counter()
    reader.join(timeout=10)
    out = "".join(line for _, line in lines)
    final = [t for t, line in lines if done in line]
    return classify(code, out, done), end - t0, (end - final[-1]) if final else None, out


def main(argv: list[str] | None = None) -> int:
    """Run the job ``--n`` times; print one line per run and the counts per outcome."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=30, help="runs (default 30)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    ap.add_argument("--trainer", choices=sorted(DONE), default="runtime",
                    help="runtime: dsforge's own launcher (default); "
                         "hf, accelerate: that plugin's example script")
    ap.add_argument("--job", default="job.yaml",
                    help="with --trainer: the example's job file (job_tp.yaml: the HF Trainer at tp=2)")
    ap.add_argument("--show", type=int, default=3000, help="characters of a bad run's output to print")
    args = ap.parse_args(argv)
    counts: collections.Counter[str] = collections.Counter()
    exits: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dsforge-exit-stress-") as tmp:
        job_dir = compile_job(Path(tmp), args.steps)
        command = None if args.trainer == "runtime" else trainer_command(args.trainer, Path(tmp), args.job)
        for i in range(1, args.n + 1):
            outcome, seconds, exit_s, out = run_once(job_dir, args.timeout, command, DONE[args.trainer])
            counts[outcome] += 1
            exits += [exit_s] if exit_s is not None and outcome != "hang" else []
            shown = f"exit {exit_s:5.1f} s" if exit_s is not None else "exit     - "
            print(f"run {i:>3}/{args.n}: {outcome:<7} {seconds:6.1f} s  {shown}", flush=True)
            if outcome != "ok":
                print("    " + out[-args.show:].replace("\n", "\n    "), flush=True)
    summary = ", ".join(f"{k} {counts[k]}" for k in ("ok", "abort", "failed", "hang", "timeout"))
    timing = f"; exit time median {statistics.median(exits):.1f} s, max {max(exits):.1f} s" if exits else ""
    what = (
        f"2 ranks x {args.steps} steps"
        if args.trainer == "runtime"
        else f"the {args.trainer} example on 2 ranks"
    )
    print(f"exit stress: {args.n} runs of {what}: {summary}{timing}", flush=True)
    return 0 if counts["ok"] == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
