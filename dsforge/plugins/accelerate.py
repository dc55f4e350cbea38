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

At tp > 1 (with sequence parallelism, ZeRO 1-2) the plugin's config carries DeepSpeed's
``tensor_parallel.autotp_size`` (parallel_model.autotp_config), as for the HF Trainer: accelerate 1.16's
``Accelerator._prepare_deepspeed`` calls deepspeed.initialize without an mpu, and with that section the engine
builds its own (dp, tp) groups, which are the plan's (else DSF706). The same section makes accelerate build a
``(tp,)`` device mesh (``state.ds_device_mesh``) in the first ``accelerator.prepare`` call, by which
``prepare_data_loader`` gives a loader part ``rank // tp`` of ``world // tp``: the ranks of one TP group read
one batch, and the dp ranks their own (the mesh is only (tp,), but only its size enters the shard, so dp > 1
works too). No ``ParallelismConfig`` is involved (one with a size above 1 is refused: DSF708). The model
prepare_model rewrote is marked ``ds_autotp_parsed`` so DeepSpeed does not split it again; accelerate's
``unwrap_model(model).save_pretrained(dir, state_dict=get_state_dict(model))`` writes the plain HF directory,
gathered from the slices (dsforge.plugins.hf_dir; ``save_model`` is those lines).
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedType, DummyOptim, DummyScheduler

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.plugins.job import (
    JobLike,
    PlanMismatchError,
    PluginError,
    TrainerJob,
    check_live,
    load_job,
    precision_of,
)
from dsforge.plugins.parallel_model import ATTR, autotp_config, own_exit, require_trainer_layout

_TRAINER = "Accelerate"

_FIX = ("build the Accelerator with dsforge.plugins.accelerate.accelerator(job), the data loader with "
        "batch_size=job.micro_batch, and start as many processes as the job plans")

_SHARD_FIX = ("pass the DataLoader (map-style data set) to accelerator.prepare, not to prepare_data_loader "
              "before it: accelerate builds the TP mesh it shards by in the first prepare call")


def deepspeed_plugin(job: JobLike) -> DeepSpeedPlugin:
    """A DeepSpeedPlugin whose config is the job's compiled ds_config, key for key (at tp > 1 with
    DeepSpeed's tensor_parallel section and its batch rule: parallel_model.autotp_config)."""
    j = require_trainer_layout(job, _TRAINER)
    config = autotp_config(j, j.ds_config(), _TRAINER)
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
    refuse_parallelism_config(j, kwargs.get("parallelism_config"))
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=j.grad_accum, **kwargs)
    refuse_parallelism_config(j, acc.parallelism_config)  # also one from accelerate's environment
    check_accelerator(j, acc)
    own_exit(j)  # the plan's groups, and at exit the engine released and the groups destroyed
    return acc


def prepare_model(job: JobLike, model: Any = None) -> Any:
    """The rank's model by the job's plan for `accelerator.prepare`
    (dsforge.plugins.parallel_model.prepare_model); without ``model`` it is built from `model.pretrained` (or
    the seed), under ZeRO-3 partitioned as it is filled."""
    from dsforge.plugins import parallel_model

    j = require_trainer_layout(job, _TRAINER)
    autotp_config(j, {}, _TRAINER)  # DSF706/DSF707 before any rank builds its shard
    return parallel_model.prepare_model(j, model)


def refuse_parallelism_config(job: JobLike, pc: Any) -> None:
    """PluginError DSF708 for an Accelerator's ParallelismConfig ``pc`` with a size above 1 (passed in, or
    from accelerate's PARALLELISM_CONFIG_* environment): accelerate would split the model or the data by its
    own mesh (transformers' tp_plan, Ulysses sp, cp) next to the job's plan."""
    j = load_job(job)
    if pc is None:
        return
    sizes = {name: getattr(pc, name, 1) for name in ("tp_size", "sp_size", "cp_size", "dp_shard_size",
                                                       "dp_replicate_size")}
    split = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 1}
    if split:
        raise PluginError(
            f"DSF708: {j.file}: the Accelerator has a ParallelismConfig with "
            f"{', '.join(f'{k}={v}' for k, v in split.items())}: accelerate would split the model or the "
            f"data by its own device mesh next to the job's plan (parallel at {j.where('parallel')}), so the "
            f"run would not be the job's. Leave parallelism_config (and accelerate's PARALLELISM_CONFIG_* "
            f"environment) out; set the degrees in the job's parallel section and build the model with "
            f"dsforge.plugins.accelerate.prepare_model(job, model).")


def check_model(job: JobLike, model: Any) -> None:
    """At tp > 1: PlanMismatchError when the prepared model is not the one prepare_model split (DeepSpeed
    would apply its own AutoTP split to a whole model, with other layers and no sequence parallelism)."""
    j = load_job(job)
    if j.plan.degrees.tp == 1 or getattr(getattr(model, "module", model), ATTR, None) is not None:
        return
    raise PlanMismatchError(
        f"the run does not match the job file {j.file}:\n  - model: the model given to accelerator.prepare "
        f"was not made by dsforge.plugins.accelerate.prepare_model, while parallel.tp={j.plan.degrees.tp} "
        f"(at {j.where('parallel', 'tp')}) splits it by the job's plan\n  fix: "
        f"model = dsforge.plugins.accelerate.prepare_model(job, model) before accelerator.prepare")


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
        batch = cfg.get("train_batch_size")
        tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1)
        if isinstance(batch, int) and isinstance(tp, int) and tp > 1:
            batch //= tp  # DeepSpeed's batch rule counts the TP ranks too (parallel_model.autotp_config)
        live.update({"micro-batch per rank": cfg.get("train_micro_batch_size_per_gpu"),
                     "gradient accumulation steps": cfg.get("gradient_accumulation_steps"),
                     "global batch": batch,
                     "ZeRO stage": cfg.get("zero_optimization", {}).get("stage", 0),
                     "precision": precision_of(cfg)})
    check_live(j, live, "the Accelerator", _FIX)


def check_dataloader(job: JobLike, loader: Any) -> None:
    """The data loader gives micro_batch samples per rank (DeepSpeed itself never checks the batch it is
    fed); at tp > 1 the prepared loader reads this rank's dp shard (PlanMismatchError naming parallel.tp)."""
    j = load_job(job)
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    check_live(j, {"micro-batch per rank": size}, "the data loader", _FIX)
    d = j.plan.degrees
    if d.tp == 1:
        return
    from accelerate.data_loader import DataLoaderDispatcher

    from dsforge.plugins.hf import check_data_shard

    if isinstance(loader, DataLoaderDispatcher) and j.plan.world_size > d.tp:
        # accelerate's dispatcher under a TP mesh sends rank 0's one batch to every rank (data_loader.py
        # _fetch_batches: batches = [batch] * num_processes), so the dp ranks would all read the same data.
        raise PlanMismatchError(
            f"the run does not match the job file {j.file}:\n  - data shards: the data loader dispatches "
            f"one batch from rank 0 to every rank (accelerate's dispatch_batches, the default for an "
            f"iterable data set), so the {j.plan.world_size // d.tp} data-parallel ranks of "
            f"parallel.tp={d.tp} (at {j.where('parallel', 'tp')}) would read the same "
            f"batch\n  fix: a map-style data set, or DataLoaderConfiguration(dispatch_batches=False) "
            f"with a loader each rank can read")
    check_data_shard(j, loader, fix=_SHARD_FIX)


def save_model(acc: Accelerator, model: Any, output_dir: str) -> None:
    """accelerate's documented save of a transformers model, ``unwrap_model(model).save_pretrained(dir,
    state_dict=get_state_dict(model))`` (every rank calls it): a plain HF directory that ``from_pretrained``
    loads, at tp > 1 gathered from the slices (dsforge.plugins.hf_dir)."""
    state = acc.get_state_dict(model)
    acc.unwrap_model(model).save_pretrained(output_dir, is_main_process=acc.is_main_process,
                                            save_function=acc.save, state_dict=state)
    acc.wait_for_everyone()


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
