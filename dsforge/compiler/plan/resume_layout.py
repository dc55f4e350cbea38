"""Whether a checkpoint written under one layout can resume under another, decided from the two compiles
alone.

Both sides are a compiled job's ``plan.json`` and ``ds_config.json`` documents (the old ones are
kept inside every checkpoint dsforge saves). A resume under another layout is exact when only the
layout changed: the parallel degrees, the ZeRO stage, the rank placement, the hardware, the
micro-batch and recomputation (the data stream is a pure function of the step and the global batch,
so a step reads the same samples whatever the split). The model, the optimizer and its settings,
the schedule, the precision, the global batch, the seed and the data must stay, else the run is
refused with a rule id (dsforge/compiler/rules/resume.py). Torch-free: `dsforge run` decides here
before any rank starts, and each rank checks the same at start-up.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

#: Keys of plan.json's ``job`` a layout-changing resume may change (the rest must be equal).
LAYOUT_JOB_KEYS: tuple[tuple[str, ...], ...] = (
    ("parallel",), ("hardware",), ("training", "micro_batch"), ("training", "recompute"),
    ("training", "steps"), ("training", "checkpoint"), ("launch",), ("search",), ("name",),
)
#: plan.json keys that describe how the ranks hold the model: when all agree, DeepSpeed's own checkpoint
#: loads.
LAYOUT_PLAN_KEYS = ("degrees", "zero", "world_size", "stage_layers", "placement", "virtual_stages")
#: DeepSpeed config keys that must agree for the optimizer state to mean the same thing under both layouts.
OPTIMIZER_DS_KEYS = ("optimizer", "scheduler", "gradient_clipping", "train_batch_size", "fp16", "bf16",
                     "zero_allow_untested_optimizer")
#: DeepSpeed config keys that only log or monitor (a `deepspeed:` override of one of them is no difference).
LOGGING_DS_KEYS = ("steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb",
                   "csv_monitor", "comet", "flops_profiler")


@dataclass(frozen=True)
class Refusal:
    """Why a checkpoint cannot resume under the new layout: rule id, what is wrong, how to fix it."""

    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"error[{self.rule}] {self.message}; fix: {self.fix}"


def same_layout(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """True when two plan.json documents place the model on the ranks identically (DeepSpeed's checkpoint
    loads)."""
    return all(old.get(k) == new.get(k) for k in LAYOUT_PLAN_KEYS)


def _drop(doc: Any, key: tuple[str, ...]) -> None:
    *parents, last = key
    for part in parents:
        doc = doc.get(part) if isinstance(doc, dict) else None
    if isinstance(doc, dict):
        doc.pop(last, None)


def flat_leaves(doc: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": leaf}`` for every leaf of nested mappings (lists are leaves)."""
    if not isinstance(doc, dict) or not doc:
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(flat_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differences(old: Any, new: Any) -> list[str]:
    """``key old -> new`` for every leaf of two nested mappings that differs, sorted by key."""
    a, b = flat_leaves(old), flat_leaves(new)
    return [f"{k} {json.dumps(a.get(k))} -> {json.dumps(b.get(k))}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def training_meaning(job: dict[str, Any]) -> dict[str, Any]:
    """plan.json's ``job`` without the keys a layout-changing resume may change (and logging overrides)."""
    out = copy.deepcopy(job)
    for key in LAYOUT_JOB_KEYS:
        _drop(out, key)
    for name in LOGGING_DS_KEYS:
        _drop(out, ("deepspeed", name))
    return out


def _optimizer_meaning(ds: dict[str, Any]) -> dict[str, Any]:
    out = {k: copy.deepcopy(ds.get(k)) for k in OPTIMIZER_DS_KEYS}
    _drop(out, ("scheduler", "params", "total_num_steps"))  # follows training.steps
    return out


def _layout_words(doc: dict[str, Any]) -> str:
    d = doc.get("degrees") or {}
    parts = [f"{k}{d[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if isinstance(d.get(k), int) and d[k] > 1]
    return f"{' x '.join(parts) or '1 rank'}, ZeRO-{doc.get('zero')}"


def padded_vocab_of(doc: dict[str, Any]) -> int | None:
    """The embedding rows the dense model of a plan.json has: vocab padded to vocab_multiple_of x tp."""
    model = (doc.get("job") or {}).get("model") or {}
    vocab, multiple = model.get("vocab"), model.get("vocab_multiple_of")
    tp = (doc.get("degrees") or {}).get("tp", 1)
    if not isinstance(vocab, int) or not isinstance(tp, int):
        return None
    if not multiple:
        return vocab
    step = int(multiple) * tp
    return -(-vocab // step) * step


def resume_refusals(old_plan: dict[str, Any], new_plan: dict[str, Any], old_ds: dict[str, Any] | None = None,
                    new_ds: dict[str, Any] | None = None) -> list[Refusal]:
    """Why the checkpoint of compile ``old`` cannot resume under compile ``new`` (empty: it can, exactly).

    Call it when the layouts differ (``same_layout`` is False); with equal layouts DeepSpeed's own
    checkpoint is loaded and only the keys of a continued run may differ (dsforge.commands.run).
    """
    out: list[Refusal] = []
    old_job, new_job = old_plan.get("job") or {}, new_plan.get("job") or {}
    was = _layout_words(old_plan)
    diff = differences(training_meaning(old_job), training_meaning(new_job))
    if diff:
        shown = "; ".join(diff[:3]) + ("; ..." if len(diff) > 3 else "")
        out.append(Refusal("DSF164", f"the checkpoint (trained under {was}) can resume under another layout "
                           f"only when the model, optimizer, schedule, precision, global batch, seed and "
                           f"data stay; this job changes {shown}",
                           "put those keys back as the checkpoint's run had them (only parallel:, hardware:, "
                           "training.micro_batch, training.recompute, training.steps, training.checkpoint "
                           "and launch: may change), or start over with `dsforge run --fresh`"))
    old_vocab, new_vocab = padded_vocab_of(old_plan), padded_vocab_of(new_plan)
    if old_vocab != new_vocab:
        out.append(Refusal("DSF165", f"the embedding has {old_vocab} rows under the checkpoint's layout "
                           f"({was}) and {new_vocab} under this one: model.vocab_multiple_of pads the "
                           f"vocabulary to a multiple of itself x tp, so the dense tensors differ in shape",
                           "choose a tp whose padding gives the same "
                           "vocabulary (or keep the checkpoint's tp)"))
    precision = ((new_job.get("training") or {}).get("precision"))
    if precision == "fp16":
        out.append(Refusal("DSF166", "an fp16 run keeps a dynamic loss scale and unmapped fp32 copies that "
                           "dsforge does not carry to another layout", "resume under the checkpoint's layout "
                           f"({was}), or train in bf16 or fp32"))
    if old_ds is not None and new_ds is not None:
        changed = differences(_optimizer_meaning(old_ds), _optimizer_meaning(new_ds))
        if changed and not diff:  # a job-key difference above already explains a changed DeepSpeed section
            out.append(Refusal("DSF167", "the new layout makes DeepSpeed build another optimizer or schedule "
                               f"than the checkpoint's ({'; '.join(changed[:3])}), so its state would not "
                               f"mean the same", "keep the hardware kind (CPU or GPU) and the `deepspeed:` "
                               "optimizer settings of the checkpoint's run, "
                               "or start over with `dsforge run --fresh`"))
    return out
