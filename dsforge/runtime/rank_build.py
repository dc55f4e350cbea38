"""What a rank builds of the job's model: the meta-device skeleton, where its values come from, and the fill.

The engine (dsforge.runtime.engine) rewrites the skeleton for the rank's layout and then calls
``fill_rank``, which gives exactly the rank's slices their values (dsforge.runtime.materialize):
from `model.pretrained`, read slice by slice, or from the job's seed. Under ZeRO-3 each parameter is
partitioned over the data-parallel group as soon as it is filled, so a rank never holds more than its
partition plus the one parameter being filled (at tp 1 it would otherwise hold the whole model until
``deepspeed.initialize`` partitions it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.materialize import PRECISION_DTYPES, WeightSource, materialize, rank_targets
from dsforge.runtime.models import build_skeleton, seeded_init
from dsforge.runtime.rewrite.planner import RewritePlan


def weight_source(plan: ResolvedPlan, skeleton: nn.Module, seed: int) -> WeightSource:
    """Where this rank's parameter values come from: the pretrained checkpoint, else the seeded
    initialisation."""
    if plan.model.pretrained:
        from dsforge.runtime.materialize import PretrainedWeights
        from dsforge.runtime.pretrained import CheckpointReader, hf_converters, hf_renamings

        reader = CheckpointReader(plan.model.pretrained, hf_renamings(skeleton), hf_converters(skeleton))
        return PretrainedWeights(reader,
                                 str(getattr(skeleton, "base_model_prefix", "") or ""))
    return seeded_init(skeleton, seed)


def rank_skeleton(plan: ResolvedPlan, seed: int) -> tuple[nn.Module, WeightSource]:
    """The job's dense model with its parameters on meta, and the source of this rank's values."""
    skeleton = build_skeleton(plan.model, plan.degrees.tp)
    return skeleton, weight_source(plan, skeleton, seed)


def fill_rank(model: nn.Module, rp: RewritePlan, groups: ParallelGroups, source: WeightSource,
              plan: ResolvedPlan, only: set[str] | None = None,
              ds_config: dict[str, Any] | None = None) -> int:
    """Give this rank's parameters (of the modules ``only`` names, or all) their values in the job's
    precision; the number of elements made real. With a ZeRO-3 ``ds_config`` each parameter is partitioned
    over the data-parallel group as soon as it is filled (``zero3_partitioner``). A pretrained load says, on
    rank 0, what it read and converted."""
    dtype = PRECISION_DTYPES[plan.spec.training.precision]
    place = zero3_partitioner(ds_config, groups,
                              dtype) if ds_config is not None and zero_stage(ds_config) == 3 \
        else None
    count = materialize(rank_targets(model, rp, groups.index("tp"), only), source, dtype, model, place)
    reader = getattr(source, "reader", None)
    if reader is not None:
        say_conversion(reader, dtype, plan)
    return count


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage a ds_config asks for (0 without a zero_optimization section)."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0) or 0)


def zero3_partitioner(ds_config: dict[str, Any], groups: ParallelGroups, dtype: torch.dtype
                      ) -> Callable[[nn.Parameter], None]:
    """A function that turns one filled parameter into a ZeRO-3 parameter holding only this rank's partition.

    It is DeepSpeed's own conversion (``zero.Init``'s, the one ``deepspeed.initialize`` applies to a
    module built outside ``zero.Init``: parameter_offload.py ``_convert_to_zero_parameters``), with the
    same data-parallel group, ds_config and dtype, applied per parameter instead of to the finished
    module: the whole parameter is freed before the next one is made. The engine then finds every
    parameter already partitioned and converts nothing (engine.py ``is_zero_init_model``). Nothing is
    patched: the Init object is never entered as a context. Init's conversion first broadcasts the
    whole parameter from the group's first rank; here every rank already holds the same values (a pure
    function of the seed, or the same checkpoint), so each keeps its partition of its own copy.
    """
    import deepspeed

    mpu = groups.mpu()
    init = deepspeed.zero.Init(data_parallel_group=mpu.get_data_parallel_group(),
                               config_dict_or_path=ds_config, dtype=dtype, mpu=mpu)

    def place(param: nn.Parameter) -> None:
        param.data = param.data.to(init.local_device)
        init._convert_to_deepspeed_param(param)
        param.partition()  # type: ignore[attr-defined]  # set on the parameter by the conversion above

    return place


def say_conversion(reader: Any, dtype: torch.dtype, plan: ResolvedPlan) -> None:
    """One line on rank 0: how many slices were read from the checkpoint, stored as what, converted to
    what."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    want = str(dtype).replace("torch.", "")
    stored = ", ".join(f"{n} {k}" for k, n in sorted(reader.stored.items()))
    converted = sum(n for k, n in reader.stored.items() if k != want)
    what = (f"converted to {want} for training.precision {plan.spec.training.precision}" if converted
            else f"kept in {want}")
    # stderr: the runtime keeps DeepSpeed's start-up chatter off stdout while the engine is built (main.quiet)
    print(f"dsforge: rank 0 read {len(reader.reads)} tensor slice(s) of {reader.directory} (stored: "
          f"{stored}); {what}", file=sys.stderr, flush=True)
