"""``run_job(job_dir)``: the entry point every rank of a compiled job runs (the job directory's train.py).

It reads plan.json and ds_config.json (never the job file), checks that the launcher started exactly
the ranks the plan places, joins the process group with a timeout, builds the plan's groups, the
rewritten model and the DeepSpeed engine, resumes from the newest checkpoint, trains, saves
checkpoints, and writes the measured memory per rank beside the cost model's prediction.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import re
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsforge.runtime.errors import RuntimeRefusal

if TYPE_CHECKING:
    from dsforge.compiler.plan.placement import Placement
    from dsforge.compiler.plan.plan import Degrees, ResolvedPlan

EXIT_OK, EXIT_FAILED = 0, 1
DEFAULT_TIMEOUT_S = 600


class JobDirError(RuntimeRefusal, ValueError):
    """The job directory cannot be run (missing or inconsistent files); the message says which."""


@dataclass(frozen=True)
class JobDir:
    """A compiled job directory: the plan rebuilt from plan.json, the DeepSpeed config, and the raw plan
    document."""

    path: Path
    plan: ResolvedPlan
    ds_config: dict[str, Any]
    doc: dict[str, Any]

    @classmethod
    def load(cls, job_dir: str | os.PathLike[str]) -> JobDir:
        """Read and cross-check plan.json and ds_config.json of ``job_dir``."""
        from dsforge.compiler.plan.plan import UnresolvedPlan, build_plan
        from dsforge.compiler.spec.schema import JobSpec
        from dsforge.compiler.spec.spec_types import SpecError

        path = Path(job_dir).resolve()
        docs = {}
        for name in ("plan.json", "ds_config.json"):
            try:
                docs[name] = json.loads((path / name).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise JobDirError(f"{path / name}: cannot read it ({exc}); "
                                  f"recompile the job with `dsforge compile`")
        doc = docs["plan.json"]
        try:
            lazy = build_plan(JobSpec.model_validate(doc["job"]))
        except (SpecError, KeyError, TypeError) as exc:
            raise JobDirError(f"{path / 'plan.json'}: its job does not fit this dsforge version's schema "
                              f"({exc}); recompile the job with `dsforge compile`") from None
        try:
            plan = lazy.resolve()
        except UnresolvedPlan:
            raise JobDirError(f"{path / 'plan.json'}: its job has no complete layout; recompile it") from None
        from dataclasses import asdict

        if asdict(plan.degrees) != doc.get("degrees") or plan.world_size != doc.get("world_size"):
            raise JobDirError(f"{path / 'plan.json'} was written by another dsforge version (its degrees "
                              f"{doc.get('degrees')} differ from "
                              f"{asdict(plan.degrees)} now); recompile the job")
        return cls(path, plan, docs["ds_config.json"], doc)

    @property
    def degrees(self) -> Degrees:
        """The plan's parallel degrees."""
        return self.plan.degrees

    @property
    def placement(self) -> Placement:
        """The plan's rank placement."""
        return self.plan.placement


def launched_world_size() -> int:
    """Processes the launcher started (torchrun / deepspeed set WORLD_SIZE; a bare `python train.py` is 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def prepare_environment(job: JobDir) -> None:
    """Before torch/deepspeed are imported: the CPU accelerator for gloo jobs, quiet DeepSpeed logs."""
    if job.doc.get("dist_backend") == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("DSFORGE_VERBOSE") != "1":
        import warnings

        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        # Harmless on every rank and every run: the pipeline engine reads the rate before the first step.
        logger.addFilter(lambda record: "before it has started" not in record.getMessage())
        # torch.distributed deprecations raised inside DeepSpeed: nothing a job can act on.
        warnings.filterwarnings("ignore", category=FutureWarning)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop what DeepSpeed prints to stdout while it starts (op builds, topology dumps) unless
    DSFORGE_VERBOSE=1."""
    if os.environ.get("DSFORGE_VERBOSE") == "1":
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def init_distributed(job: JobDir) -> None:
    """Join the job's process group (env:// from the launcher) with a timeout, so a missing rank fails, not
    hangs."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = job.doc.get("dist_backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "MASTER_ADDR" not in os.environ:  # a single process started without a launcher
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    timeout = datetime.timedelta(seconds=float(os.environ.get("DSFORGE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    from dsforge.runtime.teardown import before_init

    before_init()  # else the world group (and its threads) outlives destroy_process_group: see teardown
    dist.init_process_group(backend, timeout=timeout)


def run_job(job_dir: str | os.PathLike[str]) -> int:
    """Run the compiled job in ``job_dir`` on this rank; 0 on success, 1 with a message on stderr otherwise.

    A rank that stops because of others says so in one line naming the step: SIGTERM (a launcher
    ending the job after a rank failed) exits 143, Ctrl-C 130, a collective that failed because a
    peer is gone 1. The status file (dsforge.runtime.rank_status) records how this rank ended, for
    `dsforge run`'s report of which rank died. Errors of the job are one line; anything else is a
    bug in dsforge and keeps its traceback.
    """
    from dsforge.interrupts import catch_sigterm
    from dsforge.runtime.rank_status import RankStatus
    from dsforge.runtime.stop_watch import stopping, watch_sigterm

    rank = int(os.environ.get("RANK", "0"))
    catch_sigterm()  # torchrun stops the other ranks with SIGTERM when one fails
    status = RankStatus(Path(job_dir).resolve(), rank)
    watch_sigterm(status, rank)  # before torch starts threads: they inherit the mask
    try:
        status.update("starting")
        job = JobDir.load(job_dir)
        from dsforge.runtime.groups import check_world_size

        check_world_size(job.placement, launched_world_size())
        prepare_environment(job)
        init_distributed(job)
        run_session(job, status)
        return _finish(rank, status)
    except BaseException as exc:  # noqa: BLE001 -- each kind is reported, bugs re-raised with their traceback
        stopping()  # a launcher's SIGTERM from now on must not break this report and teardown
        try:
            return _stopped(exc, rank, status)
        finally:
            _shutdown(False)


def _stopped(exc: BaseException, rank: int, status: Any) -> int:
    """Report why this rank stopped (one line, and its status file); the exit code. Bugs are re-raised."""
    from dsforge.interrupts import Terminated, exit_code

    if isinstance(exc, KeyboardInterrupt):
        why = ("by SIGTERM (a launcher ends every rank when one fails)" if isinstance(exc, Terminated)
               else "by Ctrl-C")
        print(f"dsforge: rank {rank}: stopped {status.where()} {why}", file=sys.stderr, flush=True)
        status.update("stopped", message=why)
        return exit_code(exc)
    if isinstance(exc, Exception) and lost_peer(exc):
        why = f"after losing contact with another rank ({_first_line(exc)}): it died or stopped"
        print(f"dsforge: rank {rank}: stopped {status.where()} {why}", file=sys.stderr, flush=True)
        status.update("stopped", message=why)
        return EXIT_FAILED
    if isinstance(exc, RuntimeRefusal):  # the job's fault (layout, data, checkpoint, model): one line, no
                                         # traceback
        print(f"dsforge: rank {rank}: {exc}", file=sys.stderr, flush=True)
        status.update("failed", message=str(exc))
        return EXIT_FAILED
    status.update("failed", message=f"{type(exc).__name__}: {_first_line(exc)} (traceback above)")
    raise exc


def _finish(rank: int, status: Any) -> int:
    """Leave the process group after a barrier with the other ranks; 0, or 1 when one of them is gone."""
    try:
        _shutdown(True)
    except Exception as exc:  # the barrier: a rank that trained but did not reach the end
        if not lost_peer(exc):
            raise
        why = f"after training, when another rank did not reach the end of the run ({_first_line(exc)})"
        print(f"dsforge: rank {rank}: stopped {why}", file=sys.stderr, flush=True)
        status.update("stopped", message=why)
        return EXIT_FAILED
    status.update("done")
    return EXIT_OK


def _first_line(exc: BaseException) -> str:
    """The message's first line, without gloo's source location and its boilerplate advice."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else type(exc).__name__
    return text.split(" This is typically caused by")[0][:300]


#: What gloo, NCCL and the TCP store say when a peer process is gone or stopped answering.
LOST_PEER_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                   "timed out", "timeout", "Socket Timeout", "NCCL communicator was aborted", "ECONNRESET")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank died or hangs (not a bug of this rank)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in LOST_PEER_MARKS)


def _shutdown(finished: bool) -> None:
    """Leave the process group (after a barrier when this rank finished), its threads joined before exit."""
    from dsforge.runtime.teardown import leave

    leave(synchronize=finished)


def say(text: str) -> None:
    """Print on rank 0 only."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def describe_job(job: JobDir) -> str:
    """One header line: name, layout, batch split."""
    d, b = job.degrees, job.doc["batch"]
    layout = " x ".join(f"{k}={getattr(d, k)}" for k in ("tp", "pp", "dp", "cp",
                                                         "ep") if getattr(d, k) > 1) or "1 rank"
    return (f"dsforge: {job.plan.spec.name}: {layout}, ZeRO-{job.plan.zero}, {job.plan.world_size} ranks; "
            f"global batch {b['global_batch']} = micro {b['micro_batch']} x {b['grad_accum']} accumulation x "
            f"dp {d.dp}; {job.plan.spec.training.steps} steps")


def start_engine(job: JobDir) -> tuple[Any, Any]:
    """This rank's groups and DeepSpeed engine, DeepSpeed's start-up chatter kept quiet."""
    from dsforge.runtime.versions import require_deepspeed

    require_deepspeed()  # before deepspeed.comm is imported: an unsupported version fails in one sentence
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm

    with quiet():
        ensure_deepspeed_comm()
    groups = create_groups(job.plan)
    from dsforge.runtime.monitor import resolve_monitor_paths

    resolve_monitor_paths(job.ds_config, job.path)  # TensorBoard/CSV files inside the job directory
    # DeepSpeed's own progress prints would repeat dsforge's (steps_per_print stays the bar's interval).
    verbose = os.environ.get("DSFORGE_VERBOSE") == "1"
    config = job.ds_config if verbose else {**job.ds_config, "steps_per_print": 10**9}
    with quiet():
        return groups, build_engine(job.plan, config, groups)


def resume_point(engine: Any, policy: Any, steps: int, job: JobDir | None = None) -> int | None:
    """Steps already done by the newest checkpoint (0 without one); None when nothing is left to train.

    ``job``: this run's compile, compared with the checkpoint's own copy (another layout loads its
    layout-free state)."""
    from dsforge.runtime import checkpoint as ckpt

    start = ckpt.resume(engine, policy, job.doc if job else None, job.ds_config if job else None)
    if start:
        say(f"dsforge: resumed from {policy.directory / ckpt.tag_of(start)} after step {start}")
    if start >= steps:
        say(f"dsforge: the checkpoint has all {steps} steps; nothing to train. To train longer, raise "
            f"training.steps in the job file and run `dsforge run <job file>` again (it continues from this "
            f"checkpoint); to start over: `dsforge run --fresh <job file>`, or move {policy.directory} away")
        return None
    return start


def run_session(job: JobDir, status: Any = None) -> None:
    """Groups, engine, data, resume, training with checkpoints, then the memory report (every rank).

    ``status``: this rank's RankStatus, told each step and each checkpoint save.
    """
    from dsforge.runtime.rank_status import RankStatus
    from dsforge.runtime.teardown import release_engine

    status = status or RankStatus(job.path, int(os.environ.get("RANK", "0")))
    say(describe_job(job))
    groups, engine = start_engine(job)
    try:
        train_session(job, groups, engine, status)
    finally:
        release_engine(engine)  # else ZeRO's hooks keep the engine and its groups' threads alive until exit


def train_session(job: JobDir, groups: Any, engine: Any, status: Any) -> None:
    """Resume, train with checkpoints, then the memory report, on this rank's engine."""
    import torch.distributed as dist

    from dsforge.runtime import checkpoint as ckpt
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.faults import fault
    from dsforge.runtime.measure import ActivationProbe, StateProbe, gather_rows, rank_row
    from dsforge.runtime.train_loop import Progress, train

    plan, rank, steps = job.plan, dist.get_rank(), job.plan.spec.training.steps
    policy = ckpt.CheckpointPolicy.from_spec(plan.spec.training.checkpoint, job.path)
    status.update("resuming")
    start = resume_point(engine, policy, steps, job)
    if start is None:
        return
    if rank == 0:
        trim_log(job.path, start)
    acts, states = ActivationProbe(engine.module), StateProbe(engine)
    measure_at = start + 1 if steps - start >= 2 else start  # optimizer state exists from the second step on

    def before(step: int) -> None:
        status.update("training", step + 1)
        fault("step", step + 1)
        if step == measure_at:
            acts.arm()
            states.arm()

    def save(step: int) -> None:
        if policy.due(step, steps):
            status.update("saving", step)
            ckpt.save(engine, policy, step, job_dir=job.path)
            status.update("training")

    from dsforge.runtime.step_extras import StepExtras

    progress = Progress(steps, start, job.ds_config.get("steps_per_print", 10), rank == 0)
    extras = StepExtras(job.path, plan, groups, engine)  # validation loss and monitor scalars
    results = train(engine, batches_for(plan, groups, job.path), groups, steps=steps, start=start,
                    pipeline=job.degrees.pp > 1, progress=progress, before_step=before,
                    on_step=lambda step: (save(step), extras.on_step(step)),
                    after_step=lambda result: (log_step(job, result), extras.after_step(result)),
                    sync_at=lambda step: policy.due(step, steps))
    rows = gather_rows(rank_row(plan, rank, states.states, acts.bytes if acts.done else None))
    if rank == 0:
        # The first step pays for warm-up (lazy buffers, first collectives), the measured one for the probes.
        timed = [r for r in results if r.step not in (start + 1, measure_at + 1)] or results
        write_report(job, rows, results, timed)
        extras.report()


def trim_log(job_dir: Path, start: int) -> None:
    """Drop train_log.jsonl's lines after step ``start``: a run that resumes there trains those steps again.

    They were logged by a run that died before its next checkpoint; without them the log reads as
    one uninterrupted run.
    """
    path = job_dir / "train_log.jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    keep = []
    for line in lines:
        try:
            step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step <= start:
            keep.append(line)
    if len(keep) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        os.replace(tmp, path)


def log_step(job: JobDir, result: Any) -> None:
    """Append one step to train_log.jsonl in the job directory (rank 0)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    line = {"step": result.step, "loss": result.loss, "seconds": result.seconds,
            "tokens_per_s": result.tokens_per_s}
    with open(job.path / "train_log.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")


REPORT_NOTES = [
    "predicted: dsforge.compiler.estimate.memory for the rank's pipeline stage",
    ("activations_per_micro_batch: predicted (activations + saved logits, at the backward moment) / "
     "micro-batches in flight; measured: bytes autograd saved in one forward"),
    "peak: predicted device total incl. reserve; measured peak RSS (CPU) or max allocated (GPU)",
    ("parameters/gradients/optimizer: live storages inside the optimizer step (ZeRO has already freed the "
     "gradients it reduced into its fp32 partitions), predicted for that same moment; predicted.at_peak "
     "holds the states at the stage's peak moment, which the peak column totals"),
]


def _resume_record() -> dict[str, Any]:
    from dsforge.runtime.resume_check import RESUME_RECORD

    return dict(RESUME_RECORD)


def write_report(job: JobDir, rows: list[dict[str, Any]], results: list[Any], timed: list[Any]) -> None:
    """memory_report.json beside plan.json, and the table and a throughput line on stdout."""
    from dsforge.runtime.measure import render_table

    mean_s = sum(r.seconds for r in timed) / len(timed)
    doc = {"job": job.plan.spec.name, "units": "bytes", "ranks": rows,
           "step_seconds_mean": mean_s, "step_seconds_median": statistics.median(r.seconds for r in timed),
           "tokens_per_s_mean": sum(r.tokens_per_s for r in timed) / len(timed),
           "final_loss": results[-1].loss, "resume": _resume_record(),
           "notes": REPORT_NOTES}
    (job.path / "memory_report.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(render_table(rows), flush=True)
    print(f"dsforge: {job.plan.spec.name}: final loss {results[-1].loss:.4f}, "
          f"{doc['tokens_per_s_mean']:,.0f} tok/s, {mean_s * 1000:.0f} ms/step; wrote "
          f"{job.path / 'memory_report.json'}", flush=True)
