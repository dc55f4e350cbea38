"""`dsforge compile` and then the job directory's own launcher, as a user runs it: train.py -> run_job.

The jobs extend the repository's tiny examples with fewer steps. What they check: the launcher
starts the plan's ranks and training finishes; the job directory gets checkpoints, a training log
and memory_report.json with one row per rank (measured beside predicted); a two-node job runs as
two torchrun launchers with node ranks 0 and 1 over loopback; a launch with the wrong number of
processes stops at once with both numbers in the message. Every subprocess has a timeout, and the
ranks' process-group timeout is short, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsforge.commands.compile import compile_file
from tests.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # No venv on PATH needed: the launcher runs the interpreter that compiled it. The repository on the path.
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DSFORGE_TIMEOUT_S="120")
    return env


def compile_job(tmp: Path, name: str, text: str) -> Path:
    """Write a job file into ``tmp`` and compile it into ``tmp/name``; the job directory."""
    path = tmp / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    result = compile_file(path, tmp / name)
    assert result.written is not None, [d.message for d in result.diagnostics]
    return result.written


def launch(job_dir: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the job directory's launch.sh."""
    return subprocess.Popen(["bash", str(job_dir / "launch.sh")], env={**_env(), **(extra_env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str]) -> str:
    """Wait for a launcher (killing it on timeout); its output, after asserting it succeeded."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the launcher did not finish within {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def check_report(job_dir: Path, ranks: int, stages: int) -> dict:
    """memory_report.json has a predicted and a measured row per rank, with the measurements filled in."""
    report = json.loads((job_dir / "memory_report.json").read_text())
    rows = report["ranks"]
    assert [r["rank"] for r in rows] == list(range(ranks))
    assert {r["stage"] for r in rows} == set(range(stages))
    for r in rows:
        m = r["measured"]
        assert m["parameters"] > 0 and m["optimizer"] > 0 and m["activations_per_micro_batch"] > 0, r
        assert m["peak"] > m["parameters"] and r["predicted"]["parameters"] > 0, r
    assert report["tokens_per_s_mean"] > 0
    return report


def first_loss_on_constant_tokens(job_dir: Path, token: int) -> float:
    """The job's dense model (its seed) on a batch of one repeated token: the loss before any update."""
    import torch.nn.functional as F

    from dsforge.runtime.main import JobDir
    from dsforge.runtime.models import build_model

    spec = JobDir.load(job_dir).plan.spec
    model = build_model(spec.model, "cpu", 1, seed=spec.training.seed)
    ids = torch.full((1, spec.model.seq_len), token)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)))


@pytest.mark.slow
def test_example_trains_under_its_launcher_with_checkpoints_and_memory_report(tmp_path: Path) -> None:
    np.full(4000, 7, dtype=np.uint16).tofile(tmp_path / "train.bin")  # every sample: token 7 repeated
    job_dir = compile_job(tmp_path, "moe", f"""version: 1
extends: {ROOT / 'examples' / 'tiny-moe-ep2.yaml'}
name: tiny-moe-ep2-short
training: {{steps: 3, checkpoint: {{every: 2}}, data: {{kind: tokens, path: {tmp_path / 'train.bin'}}}}}
""")
    out = finish(launch(job_dir))
    assert "memory per rank, predicted / measured" in out and "tok/s" in out, out[-3000:]
    report = check_report(job_dir, ranks=2, stages=1)
    for row in report["ranks"]:  # parameters are exact counts on both sides (experts split over ep=2)
        assert row["measured"]["parameters"] == pytest.approx(row["predicted"]["parameters"], rel=0.02), row
        # ZeRO steps the dense and the expert group one at a time; the probe still sees both groups' state
        assert row["measured"]["optimizer"] == pytest.approx(row["predicted"]["optimizer"], rel=0.02), row
        # while the dense group steps, the expert group's reduced gradients hold the contiguous partition
        # buffer; a rank whose partition boundary cuts a tensor keeps that whole tensor's gradient in it
        # (at most the largest dense tensor, the 256 x 64 fp32 embedding here)
        grads, predicted = row["measured"]["gradients"], row["predicted"]["gradients"]
        assert 0.98 * predicted <= grads <= predicted + 256 * 64 * 4, row
    ckpt = job_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step3"
    assert (ckpt / "step2").is_dir() and (ckpt / "step3").is_dir()
    log = [json.loads(line) for line in (job_dir / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3] and all(e["loss"] > 0 for e in log)
    # The run read the token file: its first loss is the dense model's on the repeated token.
    assert log[0]["loss"] == pytest.approx(first_loss_on_constant_tokens(job_dir, 7), rel=1e-4)
    # `resume: auto`: a longer job over the same checkpoint directory trains only the missing step.
    longer = compile_job(tmp_path, "moe-longer", f"""version: 1
extends: {ROOT / 'examples' / 'tiny-moe-ep2.yaml'}
name: tiny-moe-ep2-longer
training: {{steps: 4, checkpoint: {{dir: {ckpt}}}, data: {{kind: tokens, path: {tmp_path / 'train.bin'}}}}}
""")
    out = finish(launch(longer))
    assert f"resumed from {ckpt / 'step3'} after step 3" in out, out[-3000:]
    assert [json.loads(line)["step"] for line in (longer / "train_log.jsonl").read_text().splitlines()] == [4]
    assert (ckpt / "latest").read_text().strip() == "step4"


@pytest.mark.slow
def test_two_node_job_trains_as_two_launchers_over_loopback(tmp_path: Path) -> None:
    # The compiler refuses a loopback rendezvous address for a multi-node job (DSF603: on a real cluster no
    # other node could reach it); this machine's host name resolves to loopback, which is the point here.
    host, port = socket.gethostname(), free_port()
    job_dir = compile_job(tmp_path, "twonode", f"""version: 1
extends: {ROOT / 'examples' / 'tiny-tp2-dp2.yaml'}
name: tiny-tp2-dp2-two-nodes
hardware: {{nodes: 2, gpus_per_node: 2}}
training: {{steps: 2}}
launch: {{launcher: torchrun, rdzv_backend: static, master_addr: {host}, master_port: {port}}}
""")
    procs = [launch(job_dir, {"NODE_RANK": str(n)}) for n in (0, 1)]
    outs = [finish(p) for p in procs]
    assert "memory per rank" in outs[0], outs[0][-3000:]
    report = check_report(job_dir, ranks=4, stages=1)
    assert report["final_loss"] > 0
    for row in report["ranks"]:  # the model states inside the optimizer step, as the cost model predicts them
        for key in ("parameters", "gradients", "optimizer"):
            assert row["measured"][key] == pytest.approx(row["predicted"][key], rel=0.02), (key, row)


@pytest.mark.slow
def test_wrong_number_of_processes_is_refused_with_both_numbers(tmp_path: Path) -> None:
    job_dir = compile_job(tmp_path, "wrong", f"""version: 1
extends: {ROOT / 'examples' / 'tiny-moe-ep2.yaml'}
name: wrong-world
""")
    env = {**_env(), "WORLD_SIZE": "3", "RANK": "0"}
    proc = subprocess.run([sys.executable, str(job_dir / "train.py")], check=False, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "places 2 ranks" in proc.stderr and "3 processes were launched" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
