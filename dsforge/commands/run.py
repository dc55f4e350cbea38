"""`dsforge run`: compile a job into its job directory and start the directory's local launcher (no torch
here).

The job directory defaults to ``runs/<job name>``. A directory an earlier `dsforge run` wrote is
reused when the new compile means the same training (so `resume: auto` picks up its checkpoints):
byte-for-byte the same, or different only in keys that do not change what a checkpoint holds (how
many steps, how often to save, logging, how the job is launched), in which case the job's files are
re-written and its checkpoints kept: raising `training.steps` and running again continues the run.
Any other difference is refused unless ``fresh`` discards the old run. The launcher needs nothing
from PATH: it runs the interpreter that compiled it (`launch.python` unless the job file sets one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsforge.commands.run_error import RunError
from dsforge.compiler.plan.resume_layout import flat_leaves

RUNTIME_MODULES = ("torch", "deepspeed", "transformers")
INSTALL_HINT = ("pip install torch==2.13.0 (the CPU build: pip install torch==2.13.0 --index-url "
                "https://download.pytorch.org/whl/cpu), then pip install 'dsforge[runtime]'")


#: Keys of plan.json's ``job`` that do not change what a checkpoint holds or how it is read back: the
#: length of the run (the data stream is a pure function of the step, so more steps just read on),
#: the save interval, and how the job is started (interpreter, launcher settings).
CONTINUABLE_JOB_KEYS: tuple[tuple[str, ...], ...] = (("training", "steps"),
                                                     ("training", "checkpoint", "every"), ("launch",),
                                                     ("training", "monitor"),
                                                     ("training", "checkpoint", "keep"),
                                                     ("training", "checkpoint", "if_damaged"))
#: DeepSpeed config keys that only log or monitor (in ds_config.json and in the job's `deepspeed:` overrides).
LOGGING_DS_KEYS = ("steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb",
                   "csv_monitor", "comet", "flops_profiler")
#: plan.json keys derived from the rest (estimates, the rewrite plan, the file list).
DERIVED_PLAN_KEYS = ("summary", "rewrite", "files")
#: Rules whose warnings (a file that may exist only on other machines) are errors when the job runs here.
LOCAL_FILE_RULES = ("DSF610", "DSF620")
#: DeepSpeed schedulers whose rate depends on the run's length (total_num_steps).
DECAYING_SCHEDULERS = ("WarmupCosineLR", "WarmupDecayLR")


@dataclass
class Prepared:
    """The compiled job directory to launch, and the compile's diagnostics as text.

    ``reused``: an earlier run's directory, whose checkpoints the job resumes from; ``continued``: the keys
    (``key old -> new``) in which the new compile differs from it, its files re-written (empty when
    identical).
    """

    job_dir: Path
    report: str = ""
    reused: bool = False
    notes: list[str] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)


def missing_runtime() -> list[str]:
    """The runtime packages that are not importable (checked without importing them)."""
    return [m for m in RUNTIME_MODULES if importlib.util.find_spec(m) is None]


def unsupported_deepspeed() -> str | None:
    """Why the installed DeepSpeed cannot run the job (a version outside the supported range), or None.

    Read from package metadata before any rank starts, so the answer comes in one line, not once per rank.
    """
    from dsforge.runtime.versions import deepspeed_problem, deepspeed_version

    return deepspeed_problem(deepspeed_version())


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "job"


def _identical(old: Path, new: Path) -> bool:
    """True when every file of the new compile exists in ``old`` with the same bytes."""
    names = json.loads((new / "plan.json").read_text(encoding="utf-8"))["files"]
    return all((old / n).is_file() and (old / n).read_bytes() == (new / n).read_bytes() for n in names)


def _drop(doc: Any, key: tuple[str, ...]) -> None:
    """Remove ``key`` (a path of mapping keys) from ``doc`` where it is there."""
    *parents, last = key
    for part in parents:
        doc = doc.get(part) if isinstance(doc, dict) else None
    if isinstance(doc, dict):
        doc.pop(last, None)


def _meaning(job_dir: Path) -> dict[str, Any] | None:
    """plan.json and ds_config.json without the keys a continued run may change; None if they are
    unreadable."""
    try:
        plan = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
        ds = json.loads((job_dir / "ds_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(plan, dict) or not isinstance(ds, dict) or not isinstance(plan.get("job"), dict):
        return None
    for derived in DERIVED_PLAN_KEYS:
        plan.pop(derived, None)
    for key in CONTINUABLE_JOB_KEYS:
        _drop(plan["job"], key)
    for name in LOGGING_DS_KEYS:
        _drop(plan["job"], ("deepspeed", name))
        ds.pop(name, None)
    _drop(ds, ("scheduler", "params", "total_num_steps"))  # follows training.steps
    return {"plan.json": plan, "ds_config.json": ds}


def _same_compile(old: Path, new: Path) -> bool:
    """True when two compiles mean the same training: plan.json and ds_config.json agree once the keys a
    continued run may change (CONTINUABLE_JOB_KEYS, logging, what is derived from them) are masked."""
    meaning = _meaning(old)
    return meaning is not None and meaning == _meaning(new)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key old -> new`` for every leaf that differs (keys of plan.json's job without their ``job.``
    prefix)."""
    a, b = flat_leaves(old), flat_leaves(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            name = key.removeprefix("plan.json.job.")
            out.append(f"{name} {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return out


def _changed_keys(old: Path, new: Path) -> list[str]:
    """What a continuable compile changed in the job file's terms (training.steps, checkpoint.every,
    launch)."""
    a = json.loads((old / "plan.json").read_text(encoding="utf-8"))["job"]
    b = json.loads((new / "plan.json").read_text(encoding="utf-8"))["job"]
    return _differences({"plan.json": {"job": a}}, {"plan.json": {"job": b}})


def _schedule_note(new: Path) -> list[str]:
    """A note when the continued run's learning rate depends on its new length (cosine or linear decay)."""
    ds = json.loads((new / "ds_config.json").read_text(encoding="utf-8"))
    sched = ds.get("scheduler") or {}
    if sched.get("type") not in DECAYING_SCHEDULERS:
        return []
    total = (sched.get("params") or {}).get("total_num_steps")
    return [(f"the learning rate ({sched['type']}) now decays over {total} steps; the steps already trained "
             "followed the old length, so the result differs slightly "
             "from a run that had this length from the start")]


def _rewrite_files(target: Path, new: Path) -> None:
    """Replace the compiled files of ``target`` by those of ``new``; checkpoints, logs and reports stay."""
    old_names = json.loads((target / "plan.json").read_text(encoding="utf-8")).get("files", [])
    names = json.loads((new / "plan.json").read_text(encoding="utf-8"))["files"]
    for name in old_names:
        if name not in names and (target / name).is_file():
            (target / name).unlink()
    # plan.json last: until it is replaced the directory still reads as the old compile, and is re-written
    # again.
    for name in sorted(names, key=lambda n: n == "plan.json"):
        os.replace(new / name, target / name)


def _is_job_dir(path: Path) -> bool:
    try:
        return json.loads((path / "plan.json").read_text(encoding="utf-8")).get("generator") == "dsforge"
    except (OSError, ValueError, AttributeError):
        return False


def _compile(file: str, scratch: Path) -> tuple[Path, str]:
    """Compile ``file`` into a fresh directory under ``scratch``; (directory, diagnostics text)."""
    from dsforge.commands.compile import TargetError, compile_file
    from dsforge.formatters import get

    scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dsforge-run-", dir=scratch))
    try:
        result = compile_file(file, tmp)
    except TargetError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(str(exc)) from exc
    report = get("text")(result.diagnostics)
    if result.written is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError("nothing to run: fix the errors above", 2 if result.unusable else 1, report)
    if any(d.rule in LOCAL_FILE_RULES for d in result.diagnostics):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError("nothing to run: this machine runs the job, and "
                       "a file it reads is not here (see above)", 1,
                       report)
    return tmp, report


def prepare(file: str, out: str | None, fresh: bool) -> Prepared:
    """The job directory to launch: a new compile, or the earlier run of the same compile."""
    if out:
        from dsforge.compiler.emit.writer import TargetError, refuse_working_directory

        try:
            refuse_working_directory(Path(out))  # --fresh would delete it, a rewrite would mix a job into it
        except TargetError as exc:
            raise RunError(str(exc)) from None
    from dsforge.commands.preflight import lock_for_run

    if out:
        lock_for_run(Path(out).resolve())  # before anything is written there (dsforge.runtime.run_lock)
    scratch = Path(out).resolve().parent if out else Path("runs").resolve()
    tmp, report = _compile(file, scratch)
    name = json.loads((tmp / "plan.json").read_text(encoding="utf-8"))["name"]
    target = Path(out).resolve() if out else scratch / _slug(name)
    lock_for_run(target)  # the default directory is known once the job's name is (a no-op with -o)
    try:
        if target.exists() and any(target.iterdir()):
            if not _is_job_dir(target):
                raise RunError(f"{target} exists and is not a dsforge job directory; choose another -o")
            if not fresh:
                return _continue(target, tmp, report)
            _check_fresh_checkpoints(target, tmp)
            shutil.rmtree(target)
        elif target.exists():
            target.rmdir()
        os.replace(tmp, target)
        return Prepared(target, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _continue(target: Path, tmp: Path, report: str) -> Prepared:
    """The earlier run in ``target``, its files re-written when the new compile changed only continuable keys
    or only the layout (its checkpoints then resume through their layout-free state)."""
    if _identical(target, tmp):
        return Prepared(target, report, reused=True)
    relaid = None if _same_compile(target, tmp) else _relaid(target, tmp)
    if relaid is not None:
        _rewrite_files(target, tmp)
        notes, changed = relaid
        return Prepared(target, report, reused=True, notes=notes, continued=changed)
    if not _same_compile(target, tmp):
        old, new = _meaning(target), _meaning(tmp)
        diff = _differences(old, new) if old is not None and new is not None else []
        # job keys first
        diff = [d for d in diff if not d.startswith(("plan.json.", "ds_config.json."))] or diff
        shown = f" ({'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''})" if diff else ""
        raise RunError(f"{target} holds a run of a different compile of this job{shown}, whose checkpoints "
                       "this one cannot continue (DSF164: only the layout, the length of the run, the save "
                       "interval and the launcher may change); pass --fresh to discard it (checkpoints and "
                       "reports included) or -o to run elsewhere")
    changed = _changed_keys(target, tmp) or ["the launcher files"]
    notes = _schedule_note(tmp) if any(c.startswith("training.steps ") for c in changed) else []
    _rewrite_files(target, tmp)
    return Prepared(target, report, reused=True, notes=notes, continued=changed)


def _documents(job_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    try:
        plan = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
        ds = json.loads((job_dir / "ds_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (
        (plan, ds)
        if isinstance(plan, dict) and isinstance(ds, dict) and isinstance(plan.get("job"), dict)
        else None
    )


def _relaid(target: Path, tmp: Path) -> tuple[list[str], list[str]] | None:
    """(notes, changed keys) of continuing the earlier run under a compile that changed its layout (degrees,
    ZeRO stage, hardware, micro-batch, recomputation; dsforge.compiler.plan.resume_layout) and maybe its
    length.

    None when a document is unreadable; a RunError with the rule id when the compile changed what a
    checkpoint holds (the model, optimizer, schedule, precision, global batch, seed, data).
    """
    from dsforge.compiler.plan.resume_layout import resume_refusals, same_layout

    old, new = _documents(target), _documents(tmp)
    if old is None or new is None:
        return None
    refusals = resume_refusals(old[0], new[0], old[1], new[1])
    if refusals:
        raise RunError(f"{target} holds a run of a different compile of this job, whose checkpoints this one "
                       f"cannot continue: {refusals[0]}; or pass --fresh to discard it (checkpoints and "
                       f"reports included), or -o to run elsewhere")
    changed = _changed_keys(target, tmp)
    if same_layout(old[0], new[0]):
        notes = [("each step is split differently (micro-batch or "
                  "recomputation); the checkpoint loads as it is")]
    else:
        notes = [(f"the layout changes ({_layout(old[0])} -> {_layout(new[0])}): the newest checkpoint "
                  f"resumes through its layout-free state (fp32 weights and "
                  "optimizer state, re-cut for the new ranks)")]
    if any(c.startswith("training.steps ") for c in changed):
        notes += _schedule_note(tmp)
    return notes, changed


def _layout(plan: dict[str, Any]) -> str:
    d = plan.get("degrees") or {}
    parts = [f"{k}{d[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if isinstance(d.get(k), int) and d[k] > 1]
    return f"{' x '.join(parts) or '1 rank'} ZeRO-{plan.get('zero')}"


def _check_fresh_checkpoints(target: Path, tmp: Path) -> None:
    """Refuse --fresh when the new run would still resume: its checkpoints lie outside the job directory."""
    job = json.loads((tmp / "plan.json").read_text(encoding="utf-8"))["job"]
    ckpt = job["training"]["checkpoint"]
    directory = Path(ckpt["dir"]).expanduser()
    if ckpt.get("resume") != "auto" or not directory.is_absolute():
        return  # inside the job directory, which --fresh discards
    if (directory / "latest").is_file() and not directory.resolve().is_relative_to(target.resolve()):
        raise RunError(f"--fresh discards {target}, but this job resumes from the checkpoints in {directory} "
                       "(training.checkpoint.dir, outside the job directory); move them away, or set "
                       "training.checkpoint.resume: never, to start over")


#: Seconds the launcher gets to stop its ranks after Ctrl-C (it saw it too) before it is sent SIGTERM, and
#: after SIGTERM before SIGKILL (torchrun itself gives its ranks 30 s).
CTRL_C_GRACE_S, STOP_GRACE_S = 30.0, 60.0


def launch(job_dir: Path) -> int:
    """Run the job directory's local launcher; its exit code.

    Ctrl-C or SIGTERM (raised as KeyboardInterrupt, dsforge.interrupts) stops the launcher and its
    ranks before it is re-raised: none is left training without the command that started it.
    """
    from dsforge.interrupts import Terminated
    from dsforge.runtime.rank_status import clear

    doc = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
    launcher, nodes = doc.get("launcher"), doc.get("nodes", 1)
    if launcher not in ("local", "torchrun") or nodes != 1:
        raise RunError(f"this job is started by its `{launcher}` launcher on {nodes} node(s); `dsforge run` "
                       f"starts single-node local jobs only. Run the "
                       f"launcher in {job_dir} as its README says")
    clear(job_dir)  # the ranks' status files describe this launch only
    # No PATH changes: launch.sh names its interpreter (the one that compiled it, or launch.python), so
    # `dsforge run` starts exactly what `./launch.sh` starts.
    from dsforge.commands.launcher_output import start_relay

    # stderr through dsforge (dsforge.commands.launcher_output): torchrun's ChildFailedError block must not
    # follow the report.
    proc = subprocess.Popen(["bash", str(job_dir / "launch.sh")], stderr=subprocess.PIPE)
    relay = start_relay(proc.stderr)
    try:
        return proc.wait()
    except KeyboardInterrupt as exc:
        _stop(proc, terminated=isinstance(exc, Terminated))
        raise
    finally:
        if relay is not None:
            relay.join(timeout=10)  # the ranks may hold the pipe a moment longer than the launcher


def _stop(proc: subprocess.Popen[bytes], terminated: bool) -> None:
    """Stop the launcher: wait (Ctrl-C reached its process group too), then SIGTERM, then SIGKILL."""
    waits = ([] if terminated else [(CTRL_C_GRACE_S, signal.SIGTERM)]) + [(STOP_GRACE_S, signal.SIGKILL)]
    if terminated and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
    for grace, then in waits:
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            proc.send_signal(then)
    proc.wait()


def failure_report(job_dir: Path) -> list[str]:
    """After a failed launch: which ranks died, failed or were stopped, where, and the checkpoint a rerun
    resumes from."""
    from dsforge.runtime.rank_status import describe_failure

    try:
        doc = json.loads((job_dir / "plan.json").read_text(encoding="utf-8"))
        world = int(doc["world_size"])
        ckpt = doc["job"]["training"]["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    lines = describe_failure(job_dir, world)
    directory = Path(str(ckpt.get("dir", "checkpoints"))).expanduser()
    directory = directory if directory.is_absolute() else job_dir / directory
    try:
        tag = (directory / "latest").read_text(encoding="utf-8").strip()
    except OSError:
        tag = ""
    if ckpt.get("resume") != "auto":
        lines.append("rerunning starts over (training.checkpoint.resume: never)")
    elif tag:
        lines.append(f"the last complete checkpoint is {directory / tag}: "
                     f"run the same command again to resume from it")
    else:
        lines.append("no checkpoint was completed: run the same command again to start over")
    return lines


def command(file: str, out: str | None, fresh: bool) -> None:
    """`dsforge run`: check the runtime, prepare the job directory, launch it, report; exits with its code."""
    import sys

    import click

    from dsforge.commands import EXIT_FINDINGS, EXIT_UNUSABLE
    from dsforge.runtime.run_lock import release_all

    click.get_current_context().call_on_close(release_all)  # the directory locks end with the command
    missing = missing_runtime()
    if missing:
        click.echo(f"dsforge run: this Python has no {', '.join(missing)}; "
                   f"install the runtime: {INSTALL_HINT}",
                   err=True)
        sys.exit(EXIT_UNUSABLE)
    version_problem = unsupported_deepspeed()
    if version_problem:
        click.echo(f"dsforge run: {version_problem}", err=True)
        sys.exit(EXIT_UNUSABLE)
    try:
        prepared = prepare(file, out, fresh)
        click.echo(prepared.report, nl=False)
        if prepared.continued:
            click.echo(f"dsforge run: continuing the earlier run in {prepared.job_dir} from its checkpoints "
                       f"(re-wrote its files: {'; '.join(prepared.continued)})", err=True)
        else:
            verb = "resuming the earlier run in" if prepared.reused else "compiled into"
            click.echo(f"dsforge run: {verb} {prepared.job_dir}", err=True)
        for note in prepared.notes:
            click.echo(f"dsforge run: note: {note}", err=True)
        from dsforge.commands.preflight import before_launch

        for line in before_launch(prepared.job_dir):  # the checkpoint directory's lock, free space, build
                                                      # locks
            click.echo(f"dsforge run: {line}", err=True)
        code = launch(prepared.job_dir)
    except RunError as exc:
        click.echo(exc.report, nl=False)
        click.echo(f"dsforge run: {exc}", err=True)
        sys.exit(exc.code)
    if code != 0:
        for line in failure_report(prepared.job_dir):
            click.echo(f"dsforge run: {line}", err=True)
        click.echo(f"dsforge run: the job failed (exit code {code}); see {prepared.job_dir}", err=True)
        sys.exit(EXIT_FINDINGS)
    click.echo(f"dsforge run: done ({prepared.job_dir}); to train longer, raise training.steps in {file} and "
               f"run `dsforge run {file}` again: it continues from the last checkpoint", err=True)
