"""HF Accelerate driven by a job file: a DeepSpeedPlugin holding the compiled ds_config, and a checked
Accelerator.

``deepspeed_plugin`` gives accelerate exactly the ds_config `dsforge compile` writes (accelerate
only fills "auto" values, and dsforge writes none). ``accelerator`` builds the Accelerator and checks
the live world, batch and precision against the plan. `dsforge compile` with
``launch.launcher: accelerate`` writes the matching `accelerate launch` config
(dsforge/plugins/accelerate_config.py).

On a machine without CUDA, accelerate (1.15) decides per process: without ``cpu=True`` its state is
DistributedType.NO, one process per "world", while DeepSpeed joins all ranks (so every rank reads the
whole data set); with ``cpu=True`` it skips DeepSpeed. ``accelerator`` sets up the CPU process group
first (``PartialState(cpu=True)``, as the HF Trainer's ``use_cpu`` does) and then the DeepSpeed
Accelerator on top, which gives both the right world and DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedType, DummyOptim, DummyScheduler

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.plugins.job import JobLike, TrainerJob, check_live, load_job, precision_of
from dsforge.plugins.parallel_model import own_exit, refuse_without_mpu, require_trainer_layout

#: accelerate 1.15's Accelerator._prepare_deepspeed gives deepspeed.initialize an mpu only for Ulysses
#: (sp_size).
_NO_MPU = ("accelerate's Accelerator._prepare_deepspeed and "
           "DeepSpeedPlugin take no mpu, only Ulysses' for sp_size")

_FIX = ("build the Accelerator with dsforge.plugins.accelerate.accelerator(job), the data loader with "
        "batch_size=job.micro_batch, and start as many processes as the job plans")


def deepspeed_plugin(job: JobLike) -> DeepSpeedPlugin:
    """A DeepSpeedPlugin whose config is the job's compiled ds_config, key for key."""
    j = require_trainer_layout(job, "Accelerate")
    refuse_without_mpu(j, "Accelerate", _NO_MPU)
    config = j.ds_config()
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=j.plan.zero == 3)
    # accelerate sets steps_per_print to infinity to keep DeepSpeed quiet; the job's value comes back so the
    # config accelerate hands DeepSpeed is the compiled one.
    plugin.deepspeed_config["steps_per_print"] = config["steps_per_print"]
    return plugin


def accelerator(job: JobLike, **kwargs: Any) -> Accelerator:
    """An Accelerator running the job's DeepSpeed config, checked against the plan (PlanMismatchError)."""
    j = load_job(job)
    plugin = deepspeed_plugin(j)
    from dsforge.runtime.teardown import before_init

    before_init()  # before accelerate joins the world (dsforge.runtime.teardown): no thread outlives the
                   # interpreter
    if on_cpu(j.plan):
        from accelerate.state import PartialState

        PartialState(cpu=True)  # the gloo world first; see the module docstring
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=j.grad_accum, **kwargs)
    check_accelerator(j, acc)
    own_exit(j)  # the plan's groups, and at exit the engine released and the groups destroyed
    return acc


def prepare_model(job: JobLike, model: Any = None) -> Any:
    """The rank's model by the job's plan for `accelerator.prepare`
    (dsforge.plugins.parallel_model.prepare_model); without ``model`` it is built from `model.pretrained` (or
    the seed), under ZeRO-3 partitioned as it is filled."""
    from dsforge.plugins import parallel_model

    j = require_trainer_layout(job, "Accelerate")
    refuse_without_mpu(j, "Accelerate", _NO_MPU)
    return parallel_model.prepare_model(j, model)


def check_accelerator(job: JobLike, acc: Accelerator) -> None:
    """Compare the Accelerator's world and DeepSpeed config with the plan; raise PlanMismatchError on a
    difference."""
    j = load_job(job)
    plugin = acc.state.deepspeed_plugin if acc.distributed_type == DistributedType.DEEPSPEED else None
    live: dict[str, Any] = {"world size": acc.num_processes}
    if plugin is None:
        live["ZeRO stage"] = f"none (accelerate runs {acc.distributed_type}, not DeepSpeed)"
    else:
        cfg = plugin.deepspeed_config
        live.update({"micro-batch per rank": cfg.get("train_micro_batch_size_per_gpu"),
                     "gradient accumulation steps": cfg.get("gradient_accumulation_steps"),
                     "global batch": cfg.get("train_batch_size"),
                     "ZeRO stage": cfg.get("zero_optimization", {}).get("stage", 0),
                     "precision": precision_of(cfg)})
    check_live(j, live, "the Accelerator", _FIX)


def check_dataloader(job: JobLike, loader: Any) -> None:
    """The data loader gives micro_batch samples per rank (DeepSpeed itself never checks the batch it is
    fed)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    check_live(load_job(job), {"micro-batch per rank": size}, "the data loader", _FIX)


def optimizer_and_scheduler(job: JobLike, model: Any) -> tuple[DummyOptim, DummyScheduler | None]:
    """Placeholders for `accelerator.prepare`: DeepSpeed builds the job's optimizer and schedule from the
    config."""
    j: TrainerJob = load_job(job)
    t = j.plan.spec.training
    optimizer = DummyOptim(model.parameters(), lr=t.optimizer.lr, weight_decay=t.optimizer.weight_decay)
    if "scheduler" not in j.ds_config():
        return optimizer, None
    return optimizer, DummyScheduler(optimizer, total_num_steps=t.steps,
                                     warmup_num_steps=t.scheduler.warmup_steps)
