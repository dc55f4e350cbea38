"""Bytes one checkpoint takes on disk, per rank and in total: DeepSpeed's files plus dsforge's own copies.

From the cost model's parameter shares (dsforge.compiler.estimate.shares) and ZeRO settings, per rank
of each pipeline stage (P: its parameters, Pn = P / (dp x cp) its ZeRO partition, b: bytes per
weight, k: optimizer bytes per parameter), as DeepSpeed 0.19.8 and dsforge write them:

* DeepSpeed's ``mp_rank_XX_model_states.pt``, written by the first data-parallel rank of each model
  shard: the module's weights bP (none under ZeRO-3, whose partitions live in the optimizer files);
  without ZeRO also the torch optimizer's state kP and, for 16-bit weights, its fp32 master copy 4P;
* DeepSpeed's ``zero_pp_rank_*_optim_states.pt``, written by every rank under ZeRO 1-3: the fp32
  master partition and its optimizer state, (4 + k)Pn;
* dsforge's layout-free copies, written by the first replica of every parameter (the first
  data-parallel rank): ``dsforge-weights`` bP and ``dsforge-state`` (4 + k)P (fp32 weights and each
  optimizer state), whatever the ZeRO stage;
* rank 0: the copies of plan.json and ds_config.json and the small JSON files (a fixed allowance).

Serialization overhead (pickle and safetensors headers, a few KiB per file) is in the allowance;
tests/runtime_e2e/test_machine_faults.py compares the figure with a real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.shares import layer_kinds, stage_share
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.plan.plan import Priced

FP32 = 4
#: plan.json and ds_config.json copies, the commit file and the manifest (bytes, rank 0).
SMALL_FILES = 64 * 1024


@dataclass(frozen=True)
class CheckpointSize:
    """One checkpoint's bytes: the largest rank's, each pipeline stage's first rank's, and all ranks
    together."""

    per_rank_max: float
    per_stage: tuple[float, ...]  # bytes of a rank of each stage that writes every kind of file (dp rank 0)
    total: float
    deepspeed: float  # of the total: DeepSpeed's own files
    dsforge: float  # of the total: dsforge's layout-free copies and job files

    def as_dict(self, saves: int, keep: int | str) -> dict[str, object]:
        """plan.json's `summary.checkpoint`, with the room the job's saves and retention need at their
        peak."""
        peak = peak_checkpoints(saves, keep)
        return {"bytes_per_rank_max": round(self.per_rank_max),
                "bytes_per_stage": [round(b) for b in self.per_stage], "bytes_total": round(self.total),
                "bytes_deepspeed": round(self.deepspeed), "bytes_dsforge": round(self.dsforge),
                "saves": saves, "keep": keep, "peak_checkpoints": peak,
                "bytes_needed": round(self.total * peak),
                "notes": [("one checkpoint as DeepSpeed and dsforge write it: DeepSpeed's model and ZeRO "
                           "optimizer files, plus dsforge's layout-free weights and state (export, resume "
                           "under another layout); while a save runs, training.checkpoint.keep complete ones "
                           "and the new one coexist")]}


def saves_of(steps: int, every: int) -> int:
    """How many checkpoints a run of ``steps`` steps saves: every ``every`` steps and always after the
    last."""
    if every <= 0:
        return 1
    return steps // every + (0 if steps % every == 0 else 1)


def peak_checkpoints(saves: int, keep: int | str) -> int:
    """Checkpoints on disk at once at the worst moment: ``keep`` complete ones and the one being saved."""
    return saves if not isinstance(keep, int) else min(saves, keep + 1)


def checkpoint_summary(plan: Priced) -> dict[str, object]:
    """plan.json's and explain's `checkpoint` section of ``plan``."""
    ck = plan.spec.training.checkpoint
    return checkpoint_size(plan).as_dict(saves_of(plan.spec.training.steps, ck.every), ck.keep)


def checkpoint_size(plan: Priced) -> CheckpointSize:
    """The bytes one checkpoint of ``plan`` takes (needs a valid layout)."""
    d, z = plan.degrees, zero_settings(plan)
    b, k = z.weight_bytes, z.optimizer_bytes
    replicas = d.dp * d.cp  # ranks holding the same dense shard (ZeRO partitions over them)
    per_stage: list[float] = []
    ds_total, own_total = 0.0, float(SMALL_FILES)
    for s in range(d.pp):
        share = stage_share(plan, s, z.persistence_threshold, layer_kinds(plan, s))
        p = share.total  # on one rank: its dense shard and its experts
        unique = share.dense + share.expert * max(1, d.ep)  # one tp shard of the stage, every expert once
        pn = share.dense / replicas + share.expert / max(1, d.expert_dp)
        model_file = 0.0 if z.stage == 3 else b * p
        if z.stage == 0:
            model_file += k * p + (FP32 * p if b != FP32 else 0.0)
        optim_file = (FP32 + k) * pn if z.stage >= 1 else 0.0
        own = (b + FP32 + k) * p
        per_stage.append(model_file + optim_file + own + (SMALL_FILES if s == 0 else 0.0))
        unique_model = (
            0.0
            if z.stage == 3
            else b * unique + (k * unique + (FP32 * unique if b != FP32 else 0.0) if z.stage == 0 else 0.0)
        )
        ds_total += d.tp * unique_model + d.tp * replicas * optim_file
        own_total += d.tp * (b + FP32 + k) * unique
    return CheckpointSize(max(per_stage), tuple(per_stage), ds_total + own_total, ds_total, own_total)
