"""The parallel model inside a user's own trainer: the core the HF Trainer, Accelerate and Lightning plugins
share.

Stable API (each function takes a job file path or a loaded ``TrainerJob``):

* ``start(job) -> ParallelRun``: join the launcher's world (gloo on CPU jobs), build the plan's process groups
  once per process, and own the clean exit (engines released, groups destroyed at interpreter exit, so no rank
  aborts in its exit code; the script calls no dsforge teardown function).
* ``prepare_model(job, model=None) -> nn.Module``: the rank's parallel model, by the same rewrite `dsforge
  run` applies (TP/SP layers, experts, CP attention). With ``model`` (the job's dense HF model, same weights
  on every rank) its values are moved into the rewritten modules slice by slice; without it the rank's shard
  is built from `model.pretrained` (or the job's seed) without any rank holding the whole model. The logits
  are whole on every rank, so the model's own HF loss is the job's loss.
* ``mpu(job)``: the object to pass as ``deepspeed.initialize(mpu=...)``: gradients reduced over dp, ZeRO
  partitions over dp, gradient norm summed over TP.
* ``data_shard(job) -> (dp_rank, dp_size)``: what a sampler shards over (ranks of one TP group read the same
  batch).
* ``check_batch(job, batch)``: PlanMismatchError (naming the job-file key) when the ranks of one TP group were
  fed different data (a sampler that shards over the whole world).
* ``gathered_state_dict(model)``: the dense state dict assembled from the slices (collective; rank 0 gets it).
* ``save_hf(model, directory)``: a plain HF directory (config.json, model.safetensors) written by rank 0 from
  the gathered slices, as `dsforge export` writes it; ``from_pretrained`` loads it (collective). At tp > 1
  the prepared model's ``save_pretrained`` and the trainers' own saves write it too (plugins.hf_dir).
* ``require_trainer_layout(job, trainer)``: PluginError DSF702-DSF704 for what a trainer cannot feed exactly.
* ``refuse_without_mpu(job, trainer, why)``: PluginError DSF705 for tp > 1 where the trainer's own
  ``deepspeed.initialize`` gets no mpu by any documented way (no built-in plugin: the HF Trainer and
  Accelerate use autotp_config).
* ``own_exit(job)``: for a trainer that joins the world itself: the plan's groups and the clean exit
  (start()).
* ``autotp_config(job, ds_config)``: for a trainer that calls deepspeed.initialize without an mpu (HF
  Trainer, Accelerate): the ds_config with DeepSpeed's ``tensor_parallel.autotp_size`` section, so the engine
  builds its own (dp, tp) groups, which must be the plan's (PluginError DSF706 where they are not), the
  batch rule DeepSpeed checks before it has them (every rank counted), and the flag that lets the trainers'
  own saves consolidate the slices (dsforge.plugins.hf_dir).
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from dsforge.plugins.job import JobLike, PlanMismatchError, PluginError, TrainerJob, load_job

#: Attribute of a prepared model that holds its ParallelRun and dense config.
ATTR = "_dsforge_parallel"


@dataclass
class ParallelRun:
    """This process's share of the job: the plan's groups and the ds_config the trainer's DeepSpeed gets."""

    job: TrainerJob
    groups: Any  # dsforge.runtime.groups.ParallelGroups
    ds_config: dict[str, Any] = field(default_factory=dict)

    def mpu(self) -> Any:
        """The plan's groups as DeepSpeed's mpu (dsforge.runtime.groups.DeepSpeedMPU)."""
        return self.groups.mpu()

    @property
    def dp_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return int(self.groups.index("dp"))

    @property
    def dp_size(self) -> int:
        """Data-parallel degree of the plan."""
        return int(self.groups.size("dp"))


_RUN: ParallelRun | None = None
_FAILED = False


def require_trainer_layout(job: JobLike, trainer: str) -> TrainerJob:
    """Refuse, before start, what ``trainer`` cannot feed exactly: pp (DSF702), cp (DSF703), ep (DSF704)."""
    j = load_job(job)
    d = j.plan.degrees
    alt = ("or run the job with `dsforge compile` and its launcher (dsforge.runtime feeds these layouts)")
    if d.pp > 1:
        raise PluginError(f"DSF702: {j.file}: parallel.pp={d.pp} at {j.where('parallel', 'pp')}: {trainer} "
                          f"runs one forward and backward per micro-batch over the whole module; pipeline "
                          f"stages need DeepSpeed's pipeline engine, which no "
                          f"trainer drives. Set parallel.pp to 1, {alt}.")
    if d.cp > 1:
        raise PluginError(f"DSF703: {j.file}: parallel.cp={d.cp} at {j.where('parallel', 'cp')}: {trainer}'s "
                          f"collator gives every rank whole sequences and its loss is the mean of each "
                          f"rank's tokens, while context parallelism needs each rank's slice of the "
                          f"sequence, its global positions and a loss over the whole micro-batch's tokens. "
                          f"Set parallel.cp to 1, {alt}.")
    if d.ep > 1:
        raise PluginError(f"DSF704: {j.file}: parallel.ep={d.ep} at {j.where('parallel', 'ep')}: {trainer} "
                          f"builds the optimizer over model.parameters() in one group, while expert "
                          f"parameters must be reduced over their expert-data-parallel group in their own "
                          f"optimizer groups. Set parallel.ep to 1, {alt}.")
    return j


def refuse_without_mpu(job: JobLike, trainer: str, why: str) -> TrainerJob:
    """PluginError DSF705 when tp > 1: ``trainer`` calls deepspeed.initialize without an mpu (``why`` says
    where)."""
    j = load_job(job)
    tp = j.plan.degrees.tp
    if tp > 1:
        raise PluginError(
            f"DSF705: {j.file}: tp={tp}: {trainer} passes the model to deepspeed.initialize without an mpu "
            f"({why}), so DeepSpeed would average the tensor-parallel ranks' different slices as "
            f"data-parallel replicas and compute the gradient norm without the TP group; dsforge patches no "
            f"trainer code. Set parallel.tp to 1 (at {j.where('parallel')}), or run the job with `dsforge "
            f"compile` and its launcher, or pass "
            f"dsforge.plugins.parallel_model.mpu(job) to your own deepspeed.initialize.")
    return j


def deepspeed_mesh(world: int, tp: int) -> dict[str, list[list[int]]]:
    """The tp and dp groups DeepSpeed's engine builds for ``tensor_parallel.autotp_size`` without an mpu
    (deepspeed/utils/groups.py ``_init_tp_mesh_device``: a (dp, tp) mesh, TP groups on consecutive ranks)."""
    return {"tp": [list(range(start, start + tp)) for start in range(0, world, tp)],
            "dp": [list(range(first, world, tp)) for first in range(tp)]}


def autotp_config(job: JobLike, ds_config: dict[str, Any], trainer: str) -> dict[str, Any]:
    """``ds_config`` for a trainer whose deepspeed.initialize gets no mpu, at tp > 1 (unchanged at tp 1).

    ``tensor_parallel.autotp_size`` makes DeepSpeed's engine use its groups module as the mpu, with the
    (dp, tp) groups above: gradients reduced and ZeRO partitioned over dp, the gradient norm summed over tp
    (dsforge's sharded parameters carry ``tensor_model_parallel``). DeepSpeed's own AutoTP rewrite is
    skipped for a model prepare_model made (``ds_autotp_parsed``). DeepSpeed checks the batch rule before
    the groups exist, counting every rank: ``train_batch_size`` is micro x accumulation x world, which is
    also what HF Trainer fills in; the gradient accumulation steps stay the plan's. PluginError DSF706 when
    the plan's tp or dp groups are not DeepSpeed's.
    """
    j = load_job(job)
    d = j.plan.degrees
    if d.tp == 1:
        return ds_config
    if j.plan.zero >= 3:
        raise PluginError(
            f"DSF707: {j.file}: parallel.zero={j.plan.zero} with tp={d.tp} at {j.where('parallel', 'zero')}: "
            f"through {trainer} ZeRO-3 builds the model under zero.Init with the tensor_parallel section in "
            f"HF's DeepSpeed config, where transformers' from_pretrained refuses a tensor-parallel load, and "
            f"no exact run of the rank's shard under ZeRO-3 with that section was seen. Use parallel.zero 1 "
            f"or 2 with tp > 1 (both tested equal to one process; ZeRO-3 runs at tp 1), or run the job with "
            f"`dsforge compile` and its launcher.")
    world = j.plan.world_size
    want = deepspeed_mesh(world, d.tp)
    groups = j.plan.placement.groups
    for kind in ("tp", "dp"):
        if sorted(sorted(g) for g in groups[kind]) != want[kind]:
            raise PluginError(
                f"DSF706: {j.file}: parallel.order={j.plan.spec.parallel.order!r} at "
                f"{j.where('parallel', 'order')}: {trainer} gives deepspeed.initialize no mpu, so DeepSpeed "
                f"builds its own (dp, tp) groups from tensor_parallel.autotp_size={d.tp}: {kind} groups "
                f"{want[kind]}, while the plan's are {sorted(sorted(g) for g in groups[kind])}; the model "
                f"would be reduced over other ranks than it was split across. Set parallel.order so that tp "
                f"is the fastest-varying axis followed by dp (the default 'tp-cp-ep-dp-pp'), or run the job "
                f"with `dsforge compile` and its launcher.")
    out = copy.deepcopy(ds_config)
    out["tensor_parallel"] = {"autotp_size": d.tp}
    out["train_batch_size"] = j.micro_batch * j.grad_accum * world
    # The trainers' own save (trainer.save_model, accelerator.get_state_dict) asks DeepSpeed for its
    # consolidation only with this set; it gathers dsforge's slices by their hooks (dsforge.plugins.hf_dir).
    out.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    return out


def own_exit(job: JobLike) -> ParallelRun | None:
    """Once the trainer has joined the world: the plan's groups and the clean exit (None without a world)."""
    import torch.distributed as dist

    return start(job) if dist.is_initialized() else None


def _on_exception(kind: Any, value: Any, tb: Any, previous: Any = sys.excepthook) -> None:
    global _FAILED
    _FAILED = True
    previous(kind, value, tb)


def _clean_exit() -> None:
    """At interpreter exit: release every DeepSpeed engine and destroy the groups
    (dsforge.runtime.teardown)."""
    from dsforge.runtime.teardown import leave, release_all_engines

    release_all_engines()
    leave(synchronize=not _FAILED)


def start(job: JobLike) -> ParallelRun:
    """Join the world and build the plan's groups once per process (collective); registers the clean exit."""
    global _RUN
    j = load_job(job)
    if _RUN is not None:
        if _RUN.job.plan.placement != j.plan.placement:
            raise PluginError(f"{j.file}: this process already runs the layout "
                              f"of {_RUN.job.file}; one job per process")
        return _RUN
    import torch.distributed as dist

    from dsforge.runtime.teardown import before_init

    if not dist.is_initialized():
        before_init()  # imported before the world exists, so nothing holds the world group for good
        from dsforge.runtime.api import _join

        _join(j.plan)
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm

    ensure_deepspeed_comm()
    _RUN = ParallelRun(j, create_groups(j.plan), j.ds_config())
    atexit.register(_clean_exit)
    sys.excepthook = _on_exception
    return _RUN


def mpu(job: JobLike) -> Any:
    """The object to pass as ``deepspeed.initialize(mpu=...)`` (starts the run if needed)."""
    return start(job).mpu()


def data_shard(job: JobLike) -> tuple[int, int]:
    """(dp rank, dp size): what a sampler shards over; every rank of one TP group gets the same pair."""
    run = start(job)
    return run.dp_rank, run.dp_size


@dataclass
class DenseWeights:
    """A WeightSource over the dense model's own tensors (the user's model, moved into the rewritten
    modules)."""

    tensors: dict[str, Any]

    def values(self, name: str, shape: tuple[int, ...], dim: int | None, ranges: Any,
               dtype: Any = None) -> Any:
        """The dense tensor ``name``, whole or its ``ranges`` along ``dim``."""
        import torch

        value = self.tensors.get(name)
        if value is None:
            raise PluginError(f"the model has no parameter {name}: pass the "
                              f"job's dense model (model: in the job file)")
        if tuple(value.shape) != tuple(shape):
            raise PluginError(f"{name}: the model's tensor is {list(value.shape)}, the job's model has "
                              f"{list(shape)}; the model passed to prepare_model is not the job file's model")
        if dim is None or not ranges:
            return value
        return torch.cat([value.narrow(dim, a, n) for a, n in ranges], dim=dim)


def _to_meta(model: Any) -> dict[str, Any]:
    """Move every parameter of ``model`` to meta (ties kept); returns the dense values by state-dict name.

    A model built under ``deepspeed.zero.Init`` (transformers' from_pretrained/from_config once an HF
    DeepSpeed config with ZeRO-3 exists: the Trainer's TrainingArguments, accelerate's zero3_init_flag) holds
    only this rank's partition of each parameter (shape [0], the whole shape in ``ds_shape``): each is
    gathered whole, one at a time, and its meta replacement is a plain parameter of the whole shape without
    DeepSpeed's marks, so that the rewrite plans the dense shapes and the fill partitions it afresh.
    """
    import torch
    from torch import nn

    values = {k: v.detach() for k, v in model.state_dict().items()}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            meta = done.get(id(p))
            if meta is None:
                if hasattr(p, "ds_id"):  # a ZeRO-3 partition (zero.Init)
                    whole = _gathered_whole(p)
                    for key in names.get(id(p), []):
                        if key in values:
                            values[key] = whole
                    meta = nn.Parameter(torch.empty(tuple(p.ds_shape), dtype=p.dtype, device="meta"),
                                        requires_grad=p.requires_grad)
                else:
                    meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                    meta.__dict__.update(p.__dict__)
                done[id(p)] = meta
            module._parameters[name] = meta
    return values


def _gathered_whole(param: Any) -> Any:
    """A copy of the whole value of a ZeRO-3 partitioned parameter (collective over its group)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.data.detach().to("cpu").clone()


def prepare_model(job: JobLike, model: Any = None) -> Any:
    """This rank's parallel model by the job's plan (see the module doc); the model returned is the one to
    train."""
    run = start(job)
    plan = run.job.plan
    from dsforge.runtime.engine import parallelize

    config = run.ds_config
    if model is None:
        from dsforge.runtime.models import model_config
        from dsforge.runtime.rank_build import rank_skeleton

        if plan.model.factory:
            raise PluginError(f"{run.job.file}: model.factory: build the "
                              f"model yourself and pass it to prepare_model")
        dense_config = model_config(plan.model, plan.degrees.tp)
        model, source = rank_skeleton(plan, plan.spec.training.seed)
    else:
        dense_config = copy.deepcopy(getattr(model, "config", None))
        source = DenseWeights(_to_meta(model))
    model = parallelize(model, plan, run.groups, gather_logits=True, source=source, ds_config=config)
    setattr(model, ATTR, (run, dense_config))
    if plan.degrees.tp > 1:
        # Already split by the plan: a deepspeed.initialize run with tensor_parallel.autotp_size (a trainer
        # without an mpu, autotp_config) must not apply DeepSpeed's own AutoTP rewrite on top
        # (DeepSpeedEngine._apply_autotp_partitioning returns at once for a model marked parsed).
        model.ds_autotp_parsed = True
        from dsforge.plugins.hf_dir import install

        # trainer.save_model / get_state_dict gather the slices (dsforge.plugins.hf_dir)
        install(model, run.groups.tp, save_hf, dense_config)
    return model


def _run_of(model: Any) -> tuple[ParallelRun, Any]:
    inner = getattr(model, "module", model)  # a DeepSpeed engine or a trainer's wrapper
    found = getattr(inner, ATTR, None) or getattr(model, ATTR, None)
    if found is None:
        raise PluginError("this model was not made by dsforge.plugins prepare_model")
    return found  # type: ignore[no-any-return]


def gathered_state_dict(model: Any) -> dict[str, Any] | None:
    """The dense state dict assembled from every rank's slices, on rank 0 (None elsewhere); collective."""
    import torch.distributed as dist

    from dsforge.runtime.weights_io import _gathered, assemble, tagged

    run, _ = _run_of(model)
    module = getattr(model, "module", model)
    params = tagged(module)
    mine = []
    with _gathered([p for p, _ in params if hasattr(p, "ds_id")]):
        for p, t in params:
            if getattr(p, "allreduce", True):
                keep = run.groups.index("dp") == 0
            else:
                from deepspeed.utils import groups as ds_groups

                keep = ds_groups._get_expert_data_parallel_rank(p.group_name) == 0
            if keep:
                mine.append((t.to_json(), p.detach().to("cpu").contiguous().clone()))
    everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    from dsforge.runtime.weights_io import SliceTag

    return assemble([(SliceTag.from_json(t), v) for part in everyone for t, v in part])


def save_hf(model: Any, directory: str | os.PathLike[str]) -> None:
    """Write a plain HF directory (config.json, model.safetensors) of the dense model on rank 0;
    collective."""
    import torch.distributed as dist

    dense = gathered_state_dict(model)
    _, cfg = _run_of(model)
    if dense is not None:
        from dsforge.plugins.hf_dir import write

        write(dense, cfg, directory)
    dist.barrier()


def check_batch(job: JobLike, batch: Any) -> None:
    """PlanMismatchError when the ranks of this rank's TP group hold different ``batch`` tensors
    (collective)."""
    import torch
    import torch.distributed as dist

    run = start(job)
    if run.groups.size("tp") == 1:
        return
    ids = batch if isinstance(batch, torch.Tensor) else batch["input_ids"]
    mine = torch.tensor([float(ids.shape[0]), float(ids.double().sum()), float((ids.double() ** 2).sum())])
    seen = [torch.zeros_like(mine) for _ in range(run.groups.size("tp"))]
    dist.all_gather(seen, mine, group=run.groups.tp)
    if any(not torch.equal(s, seen[0]) for s in seen):
        j = run.job
        raise PlanMismatchError(
            f"the run does not match the job file {j.file}: the ranks of one tensor-parallel group were "
            f"given different batches, while parallel.tp={j.plan.degrees.tp} (at "
            f"{j.where('parallel', 'tp')}) splits one model over them and needs the same batch on each; fix: "
            f"shard the data over the data-parallel ranks only "
            f"(dsforge.plugins.parallel_model.data_shard(job) gives the dp rank and size)")
