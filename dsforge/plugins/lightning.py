"""Lightning driven by a job file: the dsforge strategy built from the plan, the Trainer arguments that go
with it, and ``prepare_model``, the rank's model by the plan.

The strategy (``DsforgeStrategy``, dsforge/plugins/lightning_strategy.py) is Lightning's DeepSpeedStrategy
with dsforge's groups, data by dp rank, a plain HF directory in each checkpoint, a clean exit, and CPU
processes (gloo). It gets the ds_config `dsforge compile` writes, less ``gradient_accumulation_steps``:
Lightning refuses that key in a config and writes it itself from the Trainer's ``accumulate_grad_batches``
(lightning/pytorch/strategies/deepspeed.py ``_format_batch_size_and_grad_accum_config``), which
``trainer_kwargs`` sets to the plan's value. It keeps the config's micro-batch, clipping and precision
sections as they are, so what Lightning hands deepspeed.initialize is the compiled config again.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.plugins.job import JobLike, PluginError, TrainerJob, load_job
from dsforge.plugins.lightning_checks import PRECISION, check_trainer
from dsforge.plugins.lightning_strategy import DsforgeStrategy, _split, core


def strategy_config(job: JobLike) -> dict[str, Any]:
    """The compiled ds_config without gradient_accumulation_steps (Lightning fills it from the Trainer)."""
    config = load_job(job).ds_config()
    config.pop("gradient_accumulation_steps")
    return config


#: What Lightning cannot feed exactly: degree -> (rule id, why).
_REFUSED = {
    "pp": ("DSF702", ("Lightning's training loop runs one forward and backward per micro-batch on every "
                      "rank; a pipeline needs DeepSpeed's PipelineEngine schedule, "
                      "which Lightning's strategy does not drive")),
    "cp": ("DSF703", ("context parallelism needs each rank of a CP group to read its slice of every "
                      "sequence; Lightning's sampler shards whole samples, and "
                      "this plugin does not yet slice them exactly")),
    "ep": ("DSF704", "expert parallelism through Lightning is not verified exact against one process here"),
}


def require_lightning_layout(job: TrainerJob) -> None:
    """PluginError (rule id, job-file key, `dsforge compile` alternative) for a layout Lightning cannot run
    exactly."""
    d = job.plan.degrees
    for degree, (rule, why) in _REFUSED.items():
        if getattr(d, degree) > 1:
            raise PluginError(f"{rule} {job.file}: parallel.{degree}={getattr(d, degree)} (at "
                              f"{job.where('parallel', degree)}): {why}. Set parallel.{degree} to 1, or run "
                              f"the job with `dsforge compile` and its "
                              f"launcher (dsforge.runtime runs this layout).")


def deepspeed_strategy(job: JobLike, **kwargs: Any) -> DsforgeStrategy:
    """The dsforge strategy running the job's config (``kwargs`` go to the strategy, e.g. a cluster
    environment)."""
    j = load_job(job)
    require_lightning_layout(j)
    return DsforgeStrategy(j, config=strategy_config(j), **kwargs)


def prepare_model(job: JobLike, model: Any = None) -> Any:
    """The rank's parallel model by the job's plan (parallel_model's rewrite, as `dsforge run`); whole at
    tp/cp/ep=1."""
    j = load_job(job)
    require_lightning_layout(j)
    base = core()
    if base is not None and _split(j):
        return base.prepare_model(j, model)
    if model is None:
        from dsforge.runtime.models import build_model

        spec = j.plan.spec
        return build_model(spec.model, device="cpu", seed=spec.training.seed)
    return model  # data parallelism only: every rank trains the whole model


def trainer_kwargs(job: JobLike) -> dict[str, Any]:
    """pl.Trainer keywords: the strategy, accelerator, devices, nodes, precision, accumulation and steps."""
    j = load_job(job)
    plan = j.plan
    return {
        "strategy": deepspeed_strategy(j),
        "accelerator": "cpu" if on_cpu(plan) else "gpu",
        "devices": plan.gpus_per_node,
        "num_nodes": plan.nodes,
        "precision": PRECISION[plan.spec.training.precision],
        "accumulate_grad_batches": j.grad_accum,
        "max_steps": plan.spec.training.steps,
    }


class PlanCheck(pl.Callback):  # type: ignore[misc]
    """Runs ``check_trainer`` when fit starts (after the strategy is set up, before the first step)."""

    def __init__(self, job: JobLike) -> None:
        self.job = load_job(job)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the Trainer against the plan; a mismatch stops fit() before any step."""
        check_trainer(self.job, trainer)
