"""The validation loss of `training.data.valid`: every ``every`` optimizer steps, on the same fixed batches.

The batches are the first ``batches`` global batches of the validation source (its own files, or the
held-out share of the training windows), split over the ranks exactly as training batches are; the loss
is their mean of global-batch token means, reduced over dp x cp, the number one process would compute (a
pipeline engine's eval_batch averages over its micro-batches and dp, the same number for unmasked targets).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsforge.runtime.data import Batches


class Validation:
    """This rank's share of the fixed validation batches, and the losses computed so far."""

    def __init__(self, plan: Any, groups: Any) -> None:
        from dsforge.runtime.data import Sharding
        from dsforge.runtime.datasets import source_for

        t = plan.spec.training
        self.spec = t.data.valid
        source = source_for(t.data, plan.spec.model, t.seed, valid=True)
        self.groups = groups
        self.batches = Batches(source, t.global_batch, t.micro_batch,
                               Sharding(groups.size("dp"), groups.index("dp")))
        self.history: list[tuple[int, float]] = []

    def due(self, step: int) -> bool:
        """True after the optimizer steps whose validation loss is computed."""
        return step % self.spec.every == 0

    def loss(self, engine: Any, step: int) -> float:
        """The validation loss with the engine's current weights (every rank takes part)."""
        if hasattr(engine, "eval_batch"):  # a PipelineEngine: its own schedule, averaged over micro-batches
                                           # and dp
            return self._pipeline_loss(engine, step)
        device = getattr(engine, "device", None)
        total = torch.zeros((), device=device)
        was_training = engine.module.training
        engine.eval()
        try:
            with torch.no_grad():
                for b in range(self.spec.batches):
                    for mb in self.batches.step(b):
                        if device is not None and mb.ids.device != device:
                            mb = mb.to(device)
                        args = (mb.ids, mb.targets, mb.positions) + (() if mb.denominator is None
                                                                     else (mb.denominator,))
                        total += engine(*args).detach().float()
        finally:
            if was_training:
                engine.train()
        if self.groups.size("dp-cp") > 1:
            dist.all_reduce(total, group=self.groups.dp_cp)
        value = float(total) / (self.groups.size("dp") * self.batches.grad_accum * self.spec.batches)
        self.history.append((step, value))
        return value

    def _pipeline_loss(self, engine: Any, step: int) -> float:
        """The validation loss through PipelineEngine.eval_batch (its mean over micro-batches and dp)."""
        from dsforge.runtime.engine import pipeline_inputs

        total = 0.0
        try:
            for b in range(self.spec.batches):
                loss = engine.eval_batch(iter(pipeline_inputs(self.batches.step(b))), compute_loss=True,
                                         reduce_output="avg", bcast_loss=True)
                total += float(loss)
        finally:
            engine.module.train()
        # cp ranks hold shares of one sequence's loss (as in train_loop.pipeline_step); cp > 1 with pp > 1 is
        # DSF140
        value = total / self.spec.batches
        self.history.append((step, value))
        return value
