"""DsforgeStrategy: Lightning's DeepSpeedStrategy with dsforge's groups, data by dp rank, and CPU processes
(gloo).

Built on Lightning's documented extension point, a Strategy subclass
(lightning/pytorch/strategies/deepspeed.py, Lightning 2.6); no Lightning code is patched. What it changes, and
why:

* ``setup_environment`` / ``setup_distributed``: the parent refuses any accelerator but CUDA and checks that
  the devices' indices are the local ranks (a CPU device has no index). On a CPU job both checks are skipped;
  the process group is joined as the parent does (deepspeed.init_distributed with the backend Lightning picks
  for the device: gloo on CPU). A CUDA job runs the parent's code unchanged.
* ``_setup_model_and_optimizer``: the parent's deepspeed.initialize call plus ``mpu=`` (DeepSpeed's documented
  hook): with the job's mpu, gradients are reduced over dp only, ZeRO partitions over dp, and the gradient
  norm is summed over the TP group. A data-parallel-only job has no mpu (the world is the dp group).
* ``distributed_sampler_kwargs``: the sampler Lightning inserts shards over the dp ranks only, so the ranks of
  one TP group read the same batch.
* ``setup`` / ``on_train_start``: the Trainer and its data are compared with the plan before the first step
  (PlanMismatchError naming the job-file key).
* ``save_checkpoint``: Lightning's DeepSpeed checkpoint (the sharded state that ``ckpt_path`` resumes
  exactly), plus a plain HF directory ``<checkpoint>/hf`` gathered from the slices, which ``from_pretrained``
  loads.
* ``load_checkpoint``: the parent's resume; an epoch-end checkpoint's loop state is set to the next epoch's
  start (dsforge.plugins.lightning_resume: Lightning 2.6 would train one more batch), any other is refused.
* the exit: an atexit handler (registered when the world is joined) removes the engines' hooks and destroys
  the process groups while the interpreter is whole, so no rank aborts at exit and the user's script calls no
  dsforge teardown function; the groups stay up after fit for what the script does next
  (``trainer.save_checkpoint``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators.cuda import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerStatus

from dsforge.plugins.job import JobLike, PlanMismatchError, PluginError, TrainerJob, load_job

#: Where the plain HF directory goes inside a Lightning checkpoint directory.
HF_SUBDIR = "hf"


def core() -> Any:
    """The shared trainer core (dsforge.plugins.parallel_model), or None where this tree does not have it
    yet."""
    try:
        from dsforge.plugins import parallel_model
    except ImportError:
        return None
    return parallel_model


def _split(job: TrainerJob) -> bool:
    """Whether the plan splits the model (tp/cp/ep > 1): then the core's groups and rewrite are needed."""
    d = job.plan.degrees
    return any(getattr(d, k) > 1 for k in ("tp", "cp", "ep"))


def hf_model(module: torch.nn.Module) -> Any:
    """The first submodule with ``save_pretrained`` (the user's HF model inside the LightningModule), or
    None."""
    for sub in module.modules():
        if callable(getattr(sub, "save_pretrained", None)) and hasattr(sub, "config"):
            return sub
    return None


class DsforgeStrategy(DeepSpeedStrategy):  # type: ignore[misc]
    """Lightning's DeepSpeedStrategy running a dsforge job's plan, on CUDA or on CPU processes (gloo)."""

    strategy_name = "dsforge"

    def __init__(self, job: JobLike, config: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        self.job = load_job(job)
        self._mpu: Any = None

    # -- start-up
    # ---------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join the world (gloo on CPU); the parent's CUDA-only check applies to CUDA jobs only."""
        from dsforge.runtime.teardown import before_init

        before_init()  # before the world group exists (see dsforge.runtime.teardown)
        _own_exit()
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
        else:
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """The parent's process-group start, less the device-index check a CPU device cannot pass."""
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
        else:
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        base = core()
        if _split(self.job) and base is not None:
            self._mpu = base.mpu(self.job)  # the groups prepare_model built the model with

    def setup(self, trainer: Any) -> None:
        """Check the Trainer against the plan, then the parent's setup (deepspeed.initialize)."""
        from dsforge.plugins.lightning_checks import check_trainer

        check_trainer(self.job, trainer)
        super().setup(trainer)

    def _setup_model_and_optimizer(self, model: torch.nn.Module, optimizer: Any,
                                   lr_scheduler: Any = None) -> Any:
        """The parent's deepspeed.initialize, with dsforge's mpu so that reductions and ZeRO use its
        groups."""
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(
                device_rank=self.local_rank if self.root_device.index is None else self.root_device.index
            ),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            mpu=self._mpu,
        )
        return engine, ds_optimizer

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The parent's backward without DeepSpeed's own division by the accumulation steps where Lightning
        has divided already.

        Under automatic optimization Lightning hands the backward its loss over accumulate_grad_batches
        (lightning/pytorch/loops/optimization/automatic.py ClosureResult.from_training_step_output, which
        DeepSpeedStrategy sets as gradient_accumulation_steps), and DeepSpeedEngine.backward divides by the
        same count again unless told scale_wrt_gas=False: the gradients would be the batch mean over the
        accumulation steps, not the mean."""
        if self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # -- data by dp rank
    # -----------------------------------------------------------------------------------------
    def dp_shard(self) -> tuple[int, int]:
        """(dp rank, dp size) of this process: what the sampler shards over."""
        if self._mpu is not None:
            return self._mpu.get_data_parallel_rank(), self._mpu.get_data_parallel_world_size()
        return self.global_rank, self.world_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's DistributedSampler over the dp ranks (one TP group reads one batch)."""
        rank, size = self.dp_shard()
        return {"num_replicas": size, "rank": rank}

    def on_train_start(self) -> None:
        """PlanMismatchError before the first step when the loader's batch or sampler differs from the
        plan."""
        super().on_train_start()
        trainer = self.lightning_module.trainer
        check_loader(self.job, trainer.train_dataloader, self.dp_shard())

    # -- checkpoints
    # ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's sharded DeepSpeed checkpoint, then a plain HF directory ``<filepath>/hf`` from the
        slices."""
        super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(str(filepath))) / HF_SUBDIR
        save_hf_directory(self.job, self.lightning_module, target, self.is_global_zero)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The parent's DeepSpeed resume (``ckpt_path``), with an epoch-end checkpoint's loop state set to the
        next epoch's start; a checkpoint from inside an epoch is refused (DSF716)."""
        import lightning

        from dsforge.plugins.lightning_resume import (
            MEASURED_LIGHTNING,
            at_epoch_end,
            finish_epoch,
            measured_release,
        )

        if not measured_release(lightning.__version__):
            raise PluginError(
                f"DSF716 {self.job.file}: resuming through Lightning's ckpt_path ({checkpoint_path}) is "
                f"measured exact on Lightning {', '.join(MEASURED_LIGHTNING)} only, and this is Lightning "
                f"{lightning.__version__}, whose loops may restart differently. Install lightning "
                f"{MEASURED_LIGHTNING[-1]}, start a new run from the checkpoint's plain HF directory "
                f"(<checkpoint>/hf) as model.pretrained, or run the job with `dsforge compile` and its "
                f"launcher.")

        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        loops = checkpoint.get("loops") or {}
        if not at_epoch_end(loops):
            raise PluginError(
                f"DSF716 {self.job.file}: resuming through Lightning's ckpt_path ({checkpoint_path}) from a "
                f"checkpoint not saved at an epoch's end is not exact: Lightning restarts a plain DataLoader "
                f"at the epoch's first batch, so the run would see other data than the uninterrupted one. "
                f"Resume from an epoch-end checkpoint (ModelCheckpoint(save_on_train_epoch_end=True)), start "
                f"a new run from its plain HF directory (<checkpoint>/hf) as model.pretrained, or run the "
                f"job with `dsforge compile` and its launcher, whose resume is exact.")
        finish_epoch(loops)  # Lightning 2.6 would otherwise train one more batch of the finished epoch
        return checkpoint

    # -- exit
    # ----------------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """The parent's teardown; the groups stay for what the script does after fit (a save), and go at
        exit."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.status != TrainerStatus.RUNNING:
            _EXIT["failed"] = True  # interrupted: the other ranks may be gone, so no barrier at exit
        super().teardown()


#: What the exit handler knows: whether a fit failed on this rank (then it does not wait for the others).
_EXIT: dict[str, Any] = {"failed": False, "registered": False}


def _leave_at_exit() -> None:
    """At interpreter exit, while it is whole: release every DeepSpeed engine and destroy the process
    groups."""
    from dsforge.runtime.teardown import leave, release_all_engines

    release_all_engines()
    leave(synchronize=not _EXIT["failed"])


def _own_exit() -> None:
    """Register the exit handler once per process (the user's script calls no teardown function)."""
    if not _EXIT["registered"]:
        atexit.register(_leave_at_exit)
        previous = sys.excepthook

        def failed(kind: Any, value: Any, tb: Any) -> None:
            _EXIT["failed"] = True
            previous(kind, value, tb)

        sys.excepthook = failed
        _EXIT["registered"] = True


def save_hf_directory(job: TrainerJob, module: torch.nn.Module, directory: Path, is_rank_zero: bool) -> None:
    """Write the HF model inside ``module`` as a plain HF directory (gathered from the slices; collective)."""
    base = core()
    if _split(job) and base is not None:
        parts = [m for m in module.modules() if getattr(m, getattr(base, "ATTR", ""), None) is not None]
        if parts:
            base.save_hf(parts[0], directory)  # gathered from the slices, as `dsforge export` writes it
        return
    model = hf_model(module)
    if model is None:
        return  # not an HF model: Lightning's own checkpoint is all there is
    if job.plan.zero >= 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if is_rank_zero:
                model.save_pretrained(directory)
        return
    if is_rank_zero:
        model.save_pretrained(directory)  # ZeRO 0-2: every rank holds the whole, current weights


def check_loader(job: TrainerJob, loader: Any, shard: tuple[int, int]) -> None:
    """PlanMismatchError when a training DataLoader's batch size or sampler disagrees with the plan."""
    problems = []
    batch = getattr(loader, "batch_size", None)
    if batch is not None and batch != job.micro_batch:
        problems.append(f"micro-batch per rank: the DataLoader has batch_size={batch}, the job file plans "
                        f"{job.micro_batch} (training.micro_batch at {job.where('training', 'micro_batch')})")
    sampler = getattr(loader, "sampler", None)
    replicas = getattr(sampler, "num_replicas", None)
    rank, size = shard
    if replicas is not None and (replicas, getattr(sampler, "rank", rank)) != (size, rank):
        problems.append(f"data shards: the sampler splits the data {replicas} ways (this rank reads part "
                        f"{getattr(sampler, 'rank', '?')}), the job file plans {size} data-parallel ranks "
                        f"and this rank is dp rank {rank} (parallel at {job.where('parallel')}): ranks of "
                        f"one TP group must read the same batch")
    elif replicas is None and size > 1 and os.environ.get("WORLD_SIZE", "1") != "1":
        problems.append(f"data shards: the DataLoader has no distributed sampler, so every rank reads the "
                        f"same data; the job file plans {size} data-parallel "
                        f"ranks (parallel at {job.where('parallel')})")
    if problems:
        raise PlanMismatchError(
            f"the run does not match the job file {job.file}:\n  - "
            + "\n  - ".join(problems)
            + "\n  fix: use DataLoader(batch_size=job.micro_batch) and keep Lightning's "
            "distributed sampler (use_distributed_sampler=True, the default)"
        )
