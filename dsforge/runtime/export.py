"""`dsforge export JOB_DIR [--step N] -o OUT`: a checkpoint of any layout as an HF model directory.

Every checkpoint dsforge saves carries, beside DeepSpeed's files, each rank's slices of the weights
named by the dense parameter they cut (dsforge.runtime.weights_io). Export assembles the dense
tensors from them (TP cuts of fused and unfused weights, pipeline stages, experts, ZeRO-3 partitions
gathered at save, tied weights once), checks that they are exactly the parameters of the job's
dense model, and writes config.json and model.safetensors that ``from_pretrained`` loads: the
model the parallel run trained, in the dtype it trained in. The weights are written by
transformers' own ``save_pretrained`` of the job's HF model holding them (dsforge.runtime.export_hf):
MoE experts one tensor per expert and projection as it writes them (Mixtral's
``block_sparse_moe.experts.E.w1/w2/w3``), not as the stacks the transformers 5 model holds, a tied head
once, so the directory is what the checkpoint's other readers expect (and `model.pretrained` reads it back).
``on_disk`` states the same layout for the three hand-written MoE families (the reader's tests use it). The
directory appears whole or not at all, as `dsforge compile` writes a job directory
(dsforge.compiler.emit.writer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.runtime.errors import RuntimeRefusal

MARKER = "dsforge-export.json"


class ExportError(RuntimeRefusal, RuntimeError):
    """The checkpoint cannot be exported; the message says why and what to do."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    directory: Path
    step: int
    tensors: int
    parameters: int
    dtype: str


def _checkpoint(job: Any, step: int | None) -> tuple[Path, int]:
    """The committed checkpoint directory of ``step`` (default: the newest) and its step."""
    from dsforge.runtime.checkpoint import CheckpointPolicy, tag_of

    policy = CheckpointPolicy.from_spec(job.plan.spec.training.checkpoint, job.path)
    if step is None:
        tag = policy.latest_tag()
        if tag is None:
            raise ExportError(f"{policy.directory} holds no complete checkpoint (no `latest`); train the job "
                              f"first (`dsforge run`), or pass --step N of a checkpoint there")
        step = int(tag.removeprefix("step")) if tag.startswith("step") and tag[4:].isdigit() else -1
    else:
        tag = tag_of(step)
    path = policy.directory / tag
    if not path.is_dir():
        have = (
            sorted(p.name for p in policy.directory.glob("step*") if p.is_dir())
            if policy.directory.is_dir()
            else []
        )
        raise ExportError(f"{path} does not exist (checkpoints there: {', '.join(have) or 'none'})")
    from dsforge.runtime.checkpoint_manifest import DamagedCheckpoint, check

    try:
        problems = check(path)  # every file against the manifest the save wrote (none: an older dsforge's)
    except DamagedCheckpoint as exc:
        raise ExportError(str(exc)) from None
    if problems:
        raise ExportError(f"{DamagedCheckpoint(path, problems)}; export another checkpoint with --step N")
    return path, step


def assemble_checkpoint(job: Any, path: Path) -> dict[str, Any]:
    """The dense state dict of a checkpoint, checked against the job's dense model (names and shapes)."""
    from dsforge.runtime.models import build_model
    from dsforge.runtime.weights_io import WEIGHTS_DIR, assemble, load_slices

    if not (path / WEIGHTS_DIR).is_dir():
        raise ExportError(f"{path} has no {WEIGHTS_DIR}/: it was saved by a dsforge without layout-free "
                          f"weights, or its model came from model.factory or dsforge.initialize (whose "
                          f"parameters dsforge does not build); export needs "
                          f"a checkpoint of a job whose model dsforge builds")
    try:
        dense = assemble(load_slices(path))
    except ValueError as exc:
        raise ExportError(f"{path}: {exc}") from None
    d = job.degrees
    skeleton = build_model(job.plan.model, "meta", d.tp)
    want = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    have = {n: tuple(t.shape) for n, t in dense.items()}
    if want != have:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        shaped = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise ExportError(f"{path}: the saved weights are not the job's model (missing {missing[:4]}, "
                          f"unexpected {extra[:4]}, other shapes {shaped[:4]})")
    return dense


def export_checkpoint(job_dir: str | os.PathLike[str], out: str | os.PathLike[str], step: int | None = None
                      ) -> Exported:
    """Write the checkpoint ``step`` (default: the newest) of the compiled job ``job_dir`` as an HF
    directory."""
    from dsforge.compiler.emit.writer import TargetError
    from dsforge.runtime.main import JobDir, JobDirError

    try:
        job = JobDir.load(job_dir)
    except JobDirError as exc:
        raise ExportError(str(exc)) from None
    path, step = _checkpoint(job, step)
    dense = assemble_checkpoint(job, path)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in dense.values()})
    try:
        write_export(Path(out), lambda tmp: _write_hf(tmp, job, dense, dtypes, path, step))
    except TargetError as exc:
        raise ExportError(str(exc)) from None
    return Exported(Path(os.path.abspath(out)), step, len(dense), sum(t.numel() for t in dense.values()),
                    ", ".join(dtypes))


#: model_type -> (the block name on disk for the model's ``mlp``, the per-expert names of the stacked gate_up
#: rows, of down_proj): the inverse of transformers 5's load-time conversion
#: (transformers/conversion_mapping.py).
ON_DISK_EXPERTS: dict[str, tuple[str, tuple[str, str], str]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3"), "w2"),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
}


def on_disk(dense: dict[str, Any], model_type: str | None) -> dict[str, Any]:
    """The dense state dict under the names and shapes ``save_pretrained`` writes for ``model_type``.

    The model's ``<block>.mlp.experts.gate_up_proj`` [E, 2F, H] becomes E gate and E up tensors of [F, H]
    (the first F rows are the gate, as transformers concatenates them), ``down_proj`` [E, H, F] E tensors;
    Mixtral's router and experts live under ``block_sparse_moe``. Other families are returned as they are.
    """
    layout = ON_DISK_EXPERTS.get(model_type or "")
    if layout is None:
        return dense
    block_name, (gate, up), down = layout
    out: dict[str, Any] = {}
    for name, tensor in dense.items():
        head, sep, tail = name.partition(".mlp.")
        if not sep or not tail.startswith(("experts.", "gate.")):
            out[name] = tensor
            continue
        block = f"{head}.{block_name}"
        if tail == "experts.gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{block}.experts.{e}.{gate}.weight"] = tensor[e, :half]
                out[f"{block}.experts.{e}.{up}.weight"] = tensor[e, half:]
        elif tail == "experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{block}.experts.{e}.{down}.weight"] = tensor[e]
        else:
            out[f"{block}.{tail}"] = tensor
    return out


def _write_hf(tmp: Path, job: Any, dense: dict[str, Any], dtypes: list[str], source: Path, step: int) -> None:
    """config.json, the weights as ``save_pretrained`` writes them and a note of where they came from, into
    ``tmp``."""
    from dsforge.runtime.export_hf import HfExportError, save_hf
    from dsforge.runtime.models import model_config

    cfg = model_config(job.plan.model, job.degrees.tp)
    if len(dtypes) == 1:
        cfg.dtype = dtypes[0]
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    try:  # transformers writes its own layout (experts, renames, tied head): key for key what save_pretrained
          # does
        save_hf(tmp, cfg, dense, job.plan.model.pretrained)
    except HfExportError as exc:
        raise ExportError(f"{source}: {exc}") from None
    d = job.degrees
    note = {"job": job.plan.spec.name, "checkpoint": str(source), "step": step,
            "layout": {k: getattr(d, k) for k in ("tp", "pp", "dp", "cp", "ep")}, "zero": job.plan.zero,
            "dtype": dtypes, "tensors": len(dense)}
    (tmp / MARKER).write_text(json.dumps(note, indent=1) + "\n", encoding="utf-8")


def write_export(target: Path, fill: Any) -> None:
    """Fill a temporary sibling of ``target`` and rename it into place: all or nothing (compile's writer)."""
    import shutil

    from dsforge.compiler.emit import writer

    target = Path(os.path.abspath(target))
    writer.recover(target)
    if target.is_dir() and any(target.iterdir()):  # compile's own message would offer a --force export lacks
        raise writer.TargetError(f"{target} exists and is not empty; give a new directory with -o (an export "
                                 "never replaces one)")
    writer.check_target(target, force=False)
    tmp = writer._sibling(target, ".tmp")
    try:
        fill(tmp)
        with writer._signals_held():
            writer._swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
