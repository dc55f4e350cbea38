"""The compiled slurm.sbatch, submitted with `sbatch` to a real SLURM cluster, trains; a failing rank fails
the job.

The cluster is the one scripts/ci/start_slurm.sh starts on this machine (.ci/run does, before the tests):
munged, slurmctld and two slurmd daemons in SLURM's multiple-slurmd mode, nodes dsforge-n1 and
dsforge-n2 (cluster name dsforge-ci). Without `sbatch`, or when no controller of that cluster
answers, the tests skip saying so (DSFORGE_REQUIRE_SLURM=1, which .ci/run sets, turns the skip into
a failure); they never submit to any other cluster.

Two jobs are compiled by `dsforge compile` and submitted at once from a bare environment (the OS's
PATH and HOME only: no virtualenv, nothing of this process's Python), so the script must run the
interpreter that compiled it, or `launch.python` (the second job sets it). Both run over the cluster's two
nodes (one where it has one); tiny-gpt2 with AdamW (DeepSpeed's torch_adam on the CPU), 4 steps, a
checkpoint every 2:

- tp2 x dp2, 2 ranks per node: one torchrun per node, meeting at the c10d rendezvous on the first node.
  It must complete with the single-process reference's losses (tests/runtime_e2e/harness), both
  checkpoints committed, every rank's status "done" and the memory report written;
- dp2, 1 rank per node, where DSFORGE_FAULT makes rank 1 exit at the start of step 2: srun's
  --kill-on-bad-exit must end the step on the other node and the job must fail, well before the 600 s
  process-group timeout.

The 6 ranks' start-up (torch, DeepSpeed, the engine) is most of the cost: ~60 CPU-seconds for the 4-rank
job, ~25 for the failing one, ~1 minute of wall time on 2 otherwise idle cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.frontend.parse import load_job
from tests.runtime.launcher import free_port
from tests.runtime_e2e.harness import ADAMW, RTOL, reference_run, training

pytestmark = pytest.mark.slow

CLUSTER = "dsforge-ci"
#: From submission to the end of a job; the jobs take ~1 min each on 2 busy cores.
WAIT_S = 600
#: What SLURM is told (minutes): its own bound on a job that hangs, far above WAIT_S.
TIME_LIMIT_MIN = 15
FAULT = "exit:1:step:2"
#: A job that merely hung until the process-group timeout (DSFORGE_TIMEOUT_S, 600 s) would end far later.
FAILED_WITHIN_S = 120
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE")
#: The environment sbatch sees: nothing of the test's interpreter or a virtualenv.
BARE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def unavailable(reason: str) -> None:
    """Skip, or fail where CI promised a cluster (DSFORGE_REQUIRE_SLURM=1)."""
    if os.environ.get("DSFORGE_REQUIRE_SLURM") == "1":
        pytest.fail(f"DSFORGE_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def slurm(*args: str, timeout: float = 30) -> str:
    """Stdout of a SLURM client command (CalledProcessError or TimeoutExpired when it fails)."""
    return subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=timeout).stdout


def idle_nodes() -> int:
    """How many nodes the dsforge-ci test cluster has up (skips when there is none to submit to)."""
    if shutil.which("sbatch") is None:
        unavailable("no sbatch on PATH: SLURM is not installed "
                    "(scripts/ci/start_slurm.sh starts a test cluster)")
    try:
        config = slurm("scontrol", "show", "config", timeout=10)  # it retries a silent controller for long
        states = slurm("sinfo", "-h", "-N", "-o", "%N %t", timeout=10).split()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        unavailable(f"no SLURM controller answers ({exc}); scripts/ci/start_slurm.sh starts one")
    name = next((line.split("=", 1)[1].strip() for line in config.splitlines()
                 if line.replace(" ", "").startswith("ClusterName=")), "?")
    if name != CLUSTER:
        unavailable(f"the SLURM controller here is cluster {name!r}, not the {CLUSTER} test cluster of "
                    "scripts/ci/start_slurm.sh; the tests submit nothing to it")
    up = {node for node,
          state in zip(states[::2], states[1::2]) if state.rstrip("*") in ("idle", "mix", "alloc")}
    if not up:
        unavailable(f"cluster {CLUSTER} has no node up ({' '.join(states)})")
    return len(up)


@dataclass
class Submitted:
    """A compiled job directory and the SLURM job running it."""

    name: str
    job_dir: Path
    job_id: str
    submitted: float

    @property
    def output(self) -> Path:
        """The batch script's output (#SBATCH --output=%x-%j.out, in the submission directory)."""
        return self.job_dir / f"{self.name}-{self.job_id}.out"

    def log(self) -> str:
        return self.output.read_text(encoding="utf-8",
                                     errors="replace") if self.output.exists() else "(no output)"


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields of one job (the cluster keeps ended jobs for an hour: MinJobAge)."""
    text = slurm("scontrol", "show", "job", "-o", job_id)
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait(job: Submitted) -> dict[str, str]:
    """Poll until the job has ended (at most WAIT_S after submission; then it is cancelled and the test
    fails)."""
    while True:
        fields = job_fields(job.job_id)
        if fields.get("JobState") in DONE:
            return fields
        if time.monotonic() - job.submitted > WAIT_S:
            subprocess.run(["scancel", job.job_id], check=False)
            pytest.fail(f"SLURM job {job.job_id} ({job.name}) still {fields.get('JobState')} after {WAIT_S} "
                        f"s:\n{job.log()[-4000:]}")
        time.sleep(1)


def write_job(path: Path, name: str, nodes: int, gpus_per_node: int, parallel: dict[str, Any],
              **launch: Any) -> None:
    """A tiny-gpt2 job for the slurm launcher on ``nodes`` x ``gpus_per_node`` CPU ranks."""
    doc = {"version": 1, "name": name, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "nodes": nodes, "gpus_per_node": gpus_per_node},
           "parallel": {"dp": "auto", "zero": 1, **parallel},
           "training": training(**ADAMW, steps=4, checkpoint={"every": 2}),
           "launch": {"launcher": "slurm", "master_port": free_port(), **launch}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")


def submit(root: Path, name: str, nodes: int, gpus_per_node: int, parallel: dict[str, Any],
           env: dict[str, str] | None = None, **launch: Any) -> Submitted:
    """Compile the job with `dsforge compile` and submit its slurm.sbatch from its directory, in a bare
    environment."""
    write_job(root / f"{name}.yaml", name, nodes, gpus_per_node, parallel, **launch)
    job_dir = root / name
    compiled = CliRunner().invoke(cli, ["compile", str(root / f"{name}.yaml"), "-o", str(job_dir)])
    assert compiled.exit_code == 0, compiled.output
    # HOME stays: DeepSpeed's CPU accelerator builds its shm op once under ~/.cache/torch_extensions
    bare = {"PATH": BARE_PATH, "HOME": os.environ.get("HOME", str(root)), "LANG": "C.UTF-8", **(env or {})}
    if os.environ.get("PYTHONPATH"):  # a checkout tested with PYTHONPATH: its ranks import the same dsforge
        bare["PYTHONPATH"] = os.environ["PYTHONPATH"]
    job_id = subprocess.run(["sbatch", "--parsable", f"--time={TIME_LIMIT_MIN}", "slurm.sbatch"], cwd=job_dir,
                            env=bare, check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    return Submitted(name, job_dir, job_id.split(";")[0], time.monotonic())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Submitted]]:
    """Both jobs submitted at once (each takes one CPU per node: they run side by side); cancelled if left
    running.

    Over two nodes where the cluster has them (the multi-node path is the one a single node cannot show),
    else on the one node.
    """
    nodes = min(idle_nodes(), 2)
    root = tmp_path_factory.mktemp("slurm")
    submitted = {"training": submit(root, "slurm-training", nodes, 4 // nodes, {"tp": 2}),
                 "failing-rank": submit(root, "slurm-failing-rank", nodes, 2 // nodes, {},
                                        env={"DSFORGE_FAULT": FAULT}, python=sys.executable)}
    yield submitted
    for job in submitted.values():
        subprocess.run(["scancel", job.job_id], check=False, capture_output=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The single-process losses of the tp2 x dp2 job (computed while the cluster trains)."""
    path = tmp_path_factory.mktemp("slurm-reference") / "job.yaml"
    write_job(path, "slurm-reference", 1, 4, {"tp": 2})
    job = load_job(path)[0]
    assert job is not None
    return reference_run(job.spec, steps=4)[0]


def nodes_of(fields: dict[str, str]) -> int:
    return int(fields["NumNodes"])


def test_the_sbatch_script_trains(jobs: dict[str, Submitted], reference: list[float]) -> None:
    """The job completed with the reference's losses, two committed checkpoints and its reports."""
    job = jobs["training"]
    fields = wait(job)
    log = job.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    nodes = nodes_of(fields)
    assert f"--nnodes={nodes} --nproc_per_node={4 // nodes}" in log, log[:2000]
    steps = [json.loads(line) for line in (job.job_dir / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["loss"] for s in steps] == pytest.approx(reference, rel=RTOL)
    checkpoints = job.job_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step4"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step2", "step4"]
    for rank in range(4):
        status = json.loads((job.job_dir / "status" / f"rank-{rank}.json").read_text())
        assert status["phase"] == "done", status
    report = json.loads((job.job_dir / "memory_report.json").read_text())
    assert len(report["ranks"]) == 4 and report["final_loss"] == pytest.approx(steps[-1]["loss"])


def test_the_job_ran_across_two_nodes(jobs: dict[str, Submitted]) -> None:
    """Both slurmd nodes ran a torchrun of the training job, which met at the rendezvous on the first."""
    fields = wait(jobs["training"])
    if nodes_of(fields) < 2:
        unavailable(f"cluster {CLUSTER} has one node up; scripts/ci/start_slurm.sh starts two")
    assert (fields["NodeList"], fields["BatchHost"]) == ("dsforge-n[1-2]", "dsforge-n1"), fields
    assert fields["JobState"] == "COMPLETED", jobs["training"].log()[-6000:]


def test_a_failing_rank_fails_the_slurm_job(jobs: dict[str, Submitted]) -> None:
    job = jobs["failing-rank"]
    fields = wait(job)
    log = job.log()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", (fields, log[-6000:])
    assert "dsforge: rank 1: DSFORGE_FAULT: exit at step 2" in log, log[-6000:]
    if nodes_of(fields) > 1:
        # srun's --kill-on-bad-exit: the first task to fail ends the step on every node
        assert f"Terminating StepId={job.job_id}.0" in log, log[-6000:]
    statuses = [json.loads((job.job_dir / "status" / f"rank-{r}.json").read_text()) for r in range(2)]
    assert not any(s["phase"] == "done" for s in statuses), statuses
    ended = time.mktime(time.strptime(fields["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    died = float(statuses[1]["time"])  # rank 1's last word: the start of its step 2
    assert ended - died < FAILED_WITHIN_S, (fields["EndTime"], statuses)
    assert not (job.job_dir / "checkpoints" / "latest").exists()  # the first checkpoint is due after step 2
