"""HF Transformers Trainer driven by a job file: TrainingArguments keywords and a callback that checks the
run.

``training_args_kwargs`` gives the DeepSpeed config `dsforge compile` writes, as a dict, together
with the TrainingArguments that HF compares it against. HF fills and checks the config in
``HfTrainerDeepSpeedConfig.trainer_config_process``/``trainer_config_finalize``
(transformers/integrations/deepspeed.py): train_micro_batch_size_per_gpu = per_device_train_batch_size,
gradient_accumulation_steps, train_batch_size = world x micro x accumulation, gradient_clipping =
max_grad_norm, optimizer lr/betas/eps/weight_decay = learning_rate/adam_beta1,2/adam_epsilon/weight_decay,
scheduler warmup_max_lr = learning_rate, total_num_steps = max_steps, warmup_num_steps =
max(1, warmup_steps), fp16/bf16.enabled = fp16/bf16. dsforge writes concrete values (no "auto"), so
each of those keywords is set to the value HF would fill in, and HF's own mismatch check passes.

At tp > 1 (with sequence parallelism, ZeRO 1-2) the config also carries DeepSpeed's
``tensor_parallel.autotp_size`` (parallel_model.autotp_config): the Trainer calls deepspeed.initialize without
an mpu, and with that section the engine builds its own (dp, tp) groups, which are the plan's (else DSF706),
and accelerate shards the data loader over dp; the model prepare_model rewrote is marked ``ds_autotp_parsed``
so DeepSpeed does not split it again. The Trainer's own ``trainer.save_model(dir)`` writes the plain HF
directory, gathered from the slices (dsforge.plugins.hf_dir).

``DsforgeCallback`` checks world size, batch and precision against the plan when the Trainer is
built (before HF's own, less specific, check) and again when training starts (also the loader's data
shard), and at the end logs the cost model's memory next to the measured one.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from transformers import TrainerCallback, TrainingArguments

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.plugins.job import JobLike, PlanMismatchError, TrainerJob, check_live, load_job, precision_of
from dsforge.plugins.parallel_model import autotp_config, own_exit, require_trainer_layout

log = logging.getLogger("dsforge.plugins.hf")

_HF_SCHEDULE = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
_FIX = ("build the arguments with dsforge.plugins.hf.training_arguments(job, ...) without overriding these "
        "keys, and start as many processes as the job plans")


def training_args_kwargs(job: JobLike) -> dict[str, Any]:
    """TrainingArguments keywords for the job: its ds_config and the values HF checks it against."""
    j = require_trainer_layout(job, "the HF Trainer")
    t = j.plan.spec.training
    opt, sched = t.optimizer, t.scheduler
    kwargs: dict[str, Any] = {
        # tp > 1: DeepSpeed's tensor_parallel section (the Trainer passes no mpu; see autotp_config)
        "deepspeed": autotp_config(j, j.ds_config(), "the HF Trainer"),
        "per_device_train_batch_size": t.micro_batch,
        "gradient_accumulation_steps": j.grad_accum,
        "max_steps": t.steps,
        "learning_rate": opt.lr,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "weight_decay": opt.weight_decay,
        "max_grad_norm": t.grad_clip,
        "warmup_steps": sched.warmup_steps,
        # DeepSpeed runs the job's schedule (ds_config "scheduler"); HF's is named for a script that drops it.
        "lr_scheduler_type": _HF_SCHEDULE[sched.name],
        "bf16": t.precision == "bf16",
        "fp16": t.precision == "fp16",
        "seed": t.seed,
    }
    if sched.name == "cosine" and sched.min_lr > 0:
        kwargs.update(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": sched.min_lr})
    if on_cpu(j.plan):
        # Without CUDA, accelerate's state under torchrun is DistributedType.NO (one process per "world")
        # unless cpu=True: then it sets up the gloo world, and the Trainer's DeepSpeed plugin still applies.
        kwargs["use_cpu"] = True
    return kwargs


def training_arguments(job: JobLike, output_dir: str, **overrides: Any) -> TrainingArguments:
    """TrainingArguments for the job; ``overrides`` add or replace keywords (the callback checks the plan's).

    The process group is set up here (HF does it lazily, on first use): under ZeRO-3 the model must be
    built inside the full world (deepspeed.zero.Init reads the world size from it), so create the
    arguments before the model.
    """
    from dsforge.runtime.teardown import before_init

    kwargs = training_args_kwargs(job)
    before_init()  # before accelerate joins the world (dsforge.runtime.teardown): no thread outlives the
                   # interpreter
    args = TrainingArguments(output_dir=output_dir, **{**kwargs, **overrides})
    _ = args.world_size  # HF's _setup_devices: the distributed state (gloo on the CPU) exists from now on
    import torch.distributed as dist

    if dist.is_initialized():
        # With use_cpu accelerate starts torch.distributed itself; deepspeed.comm must wrap that world too,
        # or zero.Init (ZeRO-3 model construction) sees world size 1 and rejects the batch split.
        from dsforge.runtime.groups import ensure_deepspeed_comm

        ensure_deepspeed_comm()
        own_exit(job)  # the plan's groups, and at exit the engine released and the groups destroyed
    return args


def prepare_model(job: JobLike, model: Any = None) -> Any:
    """The rank's model by the job's plan for the Trainer (dsforge.plugins.parallel_model.prepare_model);
    without ``model`` it is built from `model.pretrained` (or the seed), under ZeRO-3 partitioned as it is
    filled."""
    from dsforge.plugins import parallel_model

    j = require_trainer_layout(job, "the HF Trainer")
    autotp_config(j, {}, "the HF Trainer")  # DSF706 before any rank builds its shard
    return parallel_model.prepare_model(j, model)


def save_model(trainer: Any, output_dir: str) -> None:
    """``trainer.save_model(output_dir)`` (every rank calls it): a plain HF directory that ``from_pretrained``
    loads, at tp > 1 gathered from the slices (dsforge.plugins.hf_dir)."""
    trainer.save_model(output_dir)


def _args_precision(args: TrainingArguments) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _live_ds_config() -> dict[str, Any] | None:
    """The config accelerate handed to deepspeed.initialize (HF's "auto" values filled), if DeepSpeed runs."""
    from accelerate.state import AcceleratorState

    plugin = AcceleratorState().deepspeed_plugin if AcceleratorState._shared_state else None
    return None if plugin is None else plugin.deepspeed_config


def _per_rank_batch(loader: Any) -> int | None:
    """Samples per rank per batch of a (prepared) data loader; None when it cannot tell."""
    size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "batch_sampler", None)
    if size is None and sampler is not None:
        size = getattr(sampler, "batch_size", None)
        if size is not None and getattr(sampler, "split_batches", False):
            size //= max(1, getattr(sampler, "num_processes", 1))
    return size


def _loader_shard(loader: Any) -> tuple[int, int] | None:
    """(part, parts) an accelerate-prepared loader reads (its batch sampler's shard), or None."""
    for holder in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        index, count = getattr(holder, "process_index", None), getattr(holder, "num_processes", None)
        if isinstance(index, int) and isinstance(count, int):
            return index, count
    return None


_SHARD_FIX = ("give the Trainer a map-style train_dataset and let it build the loader (accelerate shards it "
              "over the dp ranks)")


def check_data_shard(job: TrainerJob, loader: Any, rank: int | None = None, fix: str = _SHARD_FIX) -> None:
    """PlanMismatchError before the first step when the loader does not shard the data over the dp ranks.

    At tp > 1 accelerate shards a prepared loader by DeepSpeed's TP mesh (``torch_device_mesh`` from
    ``tensor_parallel.autotp_size``: part = rank // tp of world // tp), so the ranks of one TP group read
    one batch; a loader built around that (or an accelerate that does not do it) is named here.
    """
    shard = _loader_shard(loader)
    if shard is None or job.plan.degrees.tp == 1:
        return
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    dp = job.plan.placement.group_of("dp", rank)
    want = (dp.index(rank), len(dp))
    if shard != want:
        raise PlanMismatchError(
            f"the run does not match the job file {job.file}:\n  - data shards: the training data loader "
            f"reads part {shard[0]} of {shard[1]} on rank {rank}, the job file plans "
            f"{want[1]} data-parallel ranks and this rank is dp rank {want[0]} (parallel.tp="
            f"{job.plan.degrees.tp} at {job.where('parallel', 'tp')}: the ranks of one TP group must read "
            f"the same batch)\n  fix: {fix}")


class DsforgeCallback(TrainerCallback):  # type: ignore[misc]
    """Checks the live run against the job's plan before the first step; logs predicted vs measured memory."""

    def __init__(self, job: JobLike) -> None:
        self.job: TrainerJob = load_job(job)
        self.report: list[dict[str, Any]] | None = None
        self._probes: tuple[Any, Any] | None = None
        self._measure_at = 0

    def check_arguments(self, args: TrainingArguments) -> None:
        """Compare TrainingArguments (and the DeepSpeed config they carry) with the plan; raise on a
        mismatch."""
        live: dict[str, Any] = {"world size": args.world_size,
                                "micro-batch per rank": args.per_device_train_batch_size,
                                "gradient accumulation steps": args.gradient_accumulation_steps,
                                "precision": _args_precision(args)}
        ds = getattr(args, "hf_deepspeed_config", None)
        if ds is None:
            live["ZeRO stage"] = "none (TrainingArguments has no deepspeed config)"
        else:
            live["ZeRO stage"] = ds.config.get("zero_optimization", {}).get("stage", 0)
        check_live(self.job, live, "TrainingArguments", _FIX)

    def check_deepspeed(self, ds_config: dict[str, Any] | None, train_dataloader: Any) -> None:
        """Compare the config DeepSpeed was started with, the process group and the data loader with the
        plan."""
        import torch.distributed as dist

        live: dict[str, Any] = {"world size": dist.get_world_size() if dist.is_initialized() else 1}
        if ds_config is not None:
            zero = ds_config.get("zero_optimization", {})
            batch = ds_config.get("train_batch_size")
            tp = ds_config.get("tensor_parallel", {}).get("autotp_size", 1)
            if isinstance(batch, int) and isinstance(tp, int) and tp > 1:
                batch //= tp  # DeepSpeed's batch rule counts the TP ranks too (parallel_model.autotp_config)
            live.update({"micro-batch per rank": ds_config.get("train_micro_batch_size_per_gpu"),
                         "gradient accumulation steps": ds_config.get("gradient_accumulation_steps"),
                         "global batch": batch,
                         "ZeRO stage": zero.get("stage", 0) if isinstance(zero, dict) else None,
                         "precision": precision_of(ds_config)})
        check_live(self.job, live, "the DeepSpeed engine", _FIX)
        check_live(self.job, {"micro-batch per rank": _per_rank_batch(train_dataloader)},
                   "the training data loader", _FIX)
        check_data_shard(self.job, train_dataloader)

    def check_model(self, model: Any) -> None:
        """At tp > 1: PlanMismatchError when the Trainer's model is not the one prepare_model split (DeepSpeed
        would apply its own AutoTP to a whole model, with other layers and no sequence parallelism)."""
        from dsforge.plugins.parallel_model import ATTR

        j = self.job
        if model is None or j.plan.degrees.tp == 1 or getattr(getattr(model, "module", model), ATTR, None):
            return
        raise PlanMismatchError(
            f"the run does not match the job file {j.file}:\n  - model: the Trainer's model was not made by "
            f"dsforge.plugins.hf.prepare_model, while parallel.tp={j.plan.degrees.tp} (at "
            f"{j.where('parallel', 'tp')}) splits it by the job's plan\n  fix: "
            f"model = dsforge.plugins.hf.prepare_model(job, model) before building the Trainer")

    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer is built: check its arguments (HF's own check runs only inside train()) and model."""
        self.check_arguments(args)
        self.check_model(kwargs.get("model"))

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """DeepSpeed is initialised, no step has run: check the engine and arm the memory probes."""
        self.check_arguments(args)
        self.check_deepspeed(_live_ds_config(), kwargs.get("train_dataloader"))
        model, optimizer = kwargs.get("model"), getattr(kwargs.get("optimizer"), "optimizer", None)
        if model is not None and optimizer is not None:
            from dsforge.runtime.measure import ActivationProbe, StateProbe

            # Callbacks see the module and accelerate's optimizer wrapper, not the engine; the probe needs
            # only these two of it (the module, and DeepSpeed's optimizer around the torch one).
            self._probes = (StateProbe(SimpleNamespace(module=model, optimizer=optimizer)),
                            ActivationProbe(model))
            # Adam's state exists from the second optimizer step on (as dsforge.runtime.main measures it).
            self._measure_at = state.global_step + (1 if args.max_steps - state.global_step >= 2 else 0)

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """Arm the memory probes for the step the report describes."""
        if self._probes is not None and state.global_step == self._measure_at:
            for probe in self._probes:
                probe.arm()

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """Log the cost model's memory per rank next to the measured one (every rank takes part)."""
        if self._probes is None:
            return
        import torch.distributed as dist

        from dsforge.runtime.measure import gather_rows, rank_row, render_table

        states, activations = self._probes
        rank = dist.get_rank() if dist.is_initialized() else 0
        from dsforge.compiler.estimate.lean import plain_kernels  # the Trainer runs HF's own modules and loss

        self.report = gather_rows(rank_row(plain_kernels(self.job.plan).resolve(), rank, states.states,
                                           activations.bytes if activations.done else None))
        log.info("dsforge: %s", render_table(self.report))
        if rank == 0:  # like the Trainer's own metrics lines: visible without configuring logging
            print(f"dsforge: {render_table(self.report)}", flush=True)
