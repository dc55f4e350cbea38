"""What a rank builds of the job's model: the meta-device skeleton, where its values come from, and the fill.

The engine (dsforge.runtime.engine) rewrites the skeleton for the rank's layout and then calls
``fill_rank``, which gives exactly the rank's slices their values (dsforge.runtime.materialize):
from `model.pretrained`, read slice by slice, or from the job's seed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsforge.compiler.plan import Plan
from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.materialize import PRECISION_DTYPES, WeightSource, materialize, rank_targets
from dsforge.runtime.models import build_skeleton, seeded_init
from dsforge.runtime.rewrite.planner import RewritePlan


def weight_source(plan: Plan, skeleton: nn.Module, seed: int) -> WeightSource:
    """Where this rank's parameter values come from: the pretrained checkpoint, else the seeded initialisation."""
    if plan.model.pretrained:
        from dsforge.runtime.materialize import PretrainedWeights
        from dsforge.runtime.pretrained import CheckpointReader

        return PretrainedWeights(CheckpointReader(plan.model.pretrained),
                                 str(getattr(skeleton, "base_model_prefix", "") or ""))
    return seeded_init(skeleton, seed)


def rank_skeleton(plan: Plan, seed: int) -> tuple[nn.Module, WeightSource]:
    """The job's dense model with its parameters on meta, and the source of this rank's values."""
    d = plan.degrees
    skeleton = build_skeleton(plan.model, d.tp if d else 1)
    return skeleton, weight_source(plan, skeleton, seed)


def fill_rank(model: nn.Module, rp: RewritePlan, groups: ParallelGroups, source: WeightSource, plan: Plan,
              only: set[str] | None = None) -> int:
    """Give this rank's parameters (of the modules ``only`` names, or all) their values in the job's precision;
    the number of elements made real. A pretrained load says, on rank 0, what it read and converted."""
    dtype = PRECISION_DTYPES[plan.spec.training.precision]
    count = materialize(rank_targets(model, rp, groups.index("tp"), only), source, dtype, model)
    reader = getattr(source, "reader", None)
    if reader is not None:
        say_conversion(reader, dtype, plan)
    return count


def say_conversion(reader: Any, dtype: torch.dtype, plan: Plan) -> None:
    """One line on rank 0: how many slices were read from the checkpoint, stored as what, converted to what."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    want = str(dtype).replace("torch.", "")
    stored = ", ".join(f"{n} {k}" for k, n in sorted(reader.stored.items()))
    converted = sum(n for k, n in reader.stored.items() if k != want)
    what = (f"converted to {want} for training.precision {plan.spec.training.precision}" if converted
            else f"kept in {want}")
    # stderr: the runtime keeps DeepSpeed's start-up chatter off stdout while the engine is built (main.quiet)
    print(f"dsforge: rank 0 read {len(reader.reads)} tensor slice(s) of {reader.directory} (stored: {stored}); "
          f"{what}", file=sys.stderr, flush=True)
