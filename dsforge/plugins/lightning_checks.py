"""The Lightning Trainer against the plan: its world, accumulation, precision and its strategy's DeepSpeed
config (a PlanMismatchError names the job-file key of each difference). Apart from lightning.py so that the
strategy, which checks the Trainer in its setup, and the plugin's entry points do not import each other."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy

from dsforge.plugins.job import JobLike, TrainerJob, check_live, load_job, precision_of

#: Lightning precision per job precision ("mixed": fp32 master weights, as DeepSpeed keeps them).
PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
_JOB_PRECISION = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16",
                  "32-true": "fp32", "32": "fp32"}
_FIX = ("build the Trainer with dsforge.plugins.lightning.trainer_kwargs(job) "
        "and launch as many processes as planned")


def check_trainer(job: JobLike, trainer: pl.Trainer) -> None:
    """Compare the Trainer and its strategy's DeepSpeed config with the plan (PlanMismatchError on a
    difference)."""
    j: TrainerJob = load_job(job)
    live: dict[str, Any] = {"world size": trainer.num_nodes * trainer.num_devices,
                            "gradient accumulation steps": trainer.accumulate_grad_batches,
                            "precision": _JOB_PRECISION.get(str(trainer.precision), str(trainer.precision))}
    strategy = trainer.strategy
    if not isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy.config, dict):
        live["ZeRO stage"] = f"none (strategy {type(strategy).__name__})"
    check_live(j, live, "the Lightning Trainer", _FIX)
    if isinstance(strategy, DeepSpeedStrategy) and isinstance(strategy.config, dict):
        cfg = strategy.config
        # Lightning adds a bf16/fp16 section only when the config has none: the config's own section wins.
        config_live = {"micro-batch per rank": cfg.get("train_micro_batch_size_per_gpu"),
                       "ZeRO stage": cfg.get("zero_optimization", {}).get("stage", 0),
                       "precision": precision_of(cfg) if precision_of(cfg) != "fp32" else live["precision"]}
        check_live(j, config_live, "the DeepSpeed strategy's config", _FIX)
