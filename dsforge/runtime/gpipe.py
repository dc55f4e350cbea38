"""`parallel.pipeline.schedule: gpipe` on DeepSpeed's PipelineEngine: every forward, then every backward.

DeepSpeed 0.19.8's PipelineEngine runs whatever ``PipeSchedule`` its ``_train_schedule`` returns, one
instruction at a time (deepspeed/runtime/pipe/engine.py ``_exec_schedule``); its own is 1F1B
(``TrainSchedule``). GPipe (Huang et al. 2019) runs the m forward passes of a batch first and the m
backward passes after them, so each stage keeps all m micro-batches' activations (m pipeline buffers;
``dsforge.compiler.estimate.activations.in_flight`` counts the same) for the same bubble as 1F1B.
The gradients are those of 1F1B: the same micro-batches' gradients, summed in another order.

One piece of engine state assumes 1F1B: the last stage keeps only the latest micro-batch's loss
(``self.loss``), which 1F1B backpropagates right after computing it. Under GPipe the last stage
backpropagates each micro-batch long after the next forwards, so two instructions of this module
keep each loss by buffer after its forward and put it back before its backward.

The exchanges form a chain (stage s only sends forward to s + 1 and backward to s - 1, each pair in
the same micro-batch order on both sides), so blocking send/recv pairs cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MethodType
from typing import Any

from deepspeed.runtime.pipe import schedule as ds_schedule


class KeepLoss(ds_schedule.BufferOpInstruction):  # type: ignore[misc]
    """Last stage, after a forward pass: keep that micro-batch's loss under its buffer id."""


class RestoreLoss(ds_schedule.BufferOpInstruction):  # type: ignore[misc]
    """Last stage, before a backward pass: make that micro-batch's loss the one DeepSpeed backpropagates."""


class GPipeSchedule(ds_schedule.PipeSchedule):  # type: ignore[misc]
    """All forward passes of the batch, then all backward passes in reverse micro-batch order."""

    def steps(self) -> Iterator[list[Any]]:
        """One list of instructions per micro-batch pass: m forwards, m backwards, then the optimizer step."""
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        for m in range(self.micro_batches):
            cmds: list[Any] = [] if first else [ds_schedule.RecvActivation(m)]
            if first or last:
                cmds.append(ds_schedule.LoadMicroBatch(m))
            cmds.append(ds_schedule.ForwardPass(m))
            cmds.append(KeepLoss(m) if last else ds_schedule.SendActivation(m))
            yield cmds
        for m in reversed(range(self.micro_batches)):
            cmds = [RestoreLoss(m)] if last else [ds_schedule.RecvGrad(m)]
            cmds.append(ds_schedule.BackwardPass(m))
            if not first:
                cmds.append(ds_schedule.SendGrad(m))
            if m == 0:
                cmds += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(),
                         ds_schedule.OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Every micro-batch's activations are alive at the turn from forward to backward."""
        return max(2, int(self.micro_batches))


def _keep_loss(engine: Any, buffer_id: int) -> None:
    engine._dsforge_losses[buffer_id] = engine.loss


def _restore_loss(engine: Any, buffer_id: int) -> None:
    engine.loss = engine._dsforge_losses.pop(buffer_id)


def use_gpipe(engine: Any) -> Any:
    """Make a DeepSpeed PipelineEngine train every batch with the GPipe schedule; returns the engine."""
    engine._dsforge_losses = {}
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, KeepLoss: _keep_loss,
                               RestoreLoss: _restore_loss}

    def train_schedule(self: Any) -> GPipeSchedule:
        return GPipeSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    engine._train_schedule = MethodType(train_schedule, engine)
    return engine
