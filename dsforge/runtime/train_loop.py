"""The training loop: optimizer steps over the job's batches, with loss, tokens/s and memory on rank 0.

A plain engine runs forward / backward / step per micro-batch (DeepSpeed steps the optimizer at the
accumulation boundary); a pipeline engine takes the whole step's micro-batches through
``train_batch``. The logged loss is the global batch's mean next-token loss, the same number a
single process training on the whole global batch would print.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.distributed as dist

from dsforge.runtime.data import Batches
from dsforge.runtime.errors import RuntimeRefusal
from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.measure import mib, peak_bytes


class TrainingError(RuntimeRefusal, RuntimeError):
    """Training cannot go on (the loss is no longer finite); the message says at which step."""


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: its 1-based number, the global mean loss, wall seconds and throughput."""

    step: int
    loss: float
    seconds: float
    tokens_per_s: float


class PendingLoss:
    """A step's global mean loss whose all-reduce may still be in flight (``value()`` waits for it)."""

    def __init__(self, total: torch.Tensor, divisor: float, work: Any = None) -> None:
        self.total, self.divisor, self.work = total, divisor, work

    def value(self) -> float:
        """The loss, once the reduction has finished."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return float(self.total) / self.divisor

    def settle(self) -> None:
        """Wait for a reduction still in flight, ignoring its failure: a step abandoned by an error.

        No collective may outlive the loop: a rank leaving the group while another still reduces
        with it turns one rank's error into a broken connection on the other.
        """
        if self.work is not None:
            with contextlib.suppress(Exception):
                self.work.wait()
            self.work = None


def plain_step(engine: Any, batches: Batches, step: int, groups: ParallelGroups) -> PendingLoss:
    """One optimizer step of a plain engine (0-based ``step``); the global batch's mean loss, being
    reduced."""
    device = getattr(engine, "device", None)
    total = torch.zeros((), device=device)  # NCCL reduces device tensors only
    for mb in batches.step(step):
        if device is not None and mb.ids.device != device:  # the plain engine leaves inputs where they are
            mb = mb.to(device)
        loss = engine(mb.ids, mb.targets, mb.positions) if mb.denominator is None else \
            engine(mb.ids, mb.targets, mb.positions, mb.denominator)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    # Each rank holds its micro-batches' (cp: share of the) mean; sum over dp x cp, average over dp. The sum
    # runs while the next step computes: a blocking one would add a synchronisation point to every step.
    work = dist.all_reduce(total, group=groups.dp_cp, async_op=True) if groups.size("dp-cp") > 1 else None
    return PendingLoss(total, groups.size("dp") * batches.grad_accum, work)


def pipeline_step(engine: Any, batches: Batches, step: int, groups: ParallelGroups) -> PendingLoss:
    """One optimizer step of a pipeline engine; DeepSpeed averages the loss over its data axis (dp x cp)."""
    from dsforge.runtime.engine import pipeline_inputs

    loss = engine.train_batch(data_iter=iter(pipeline_inputs(batches.step(step))))
    # cp ranks hold shares of one sequence's loss, not replicas: undo the average over them.
    return PendingLoss(loss.detach().float().cpu() * groups.size("cp"), 1.0)


class Progress:
    """A one-line progress bar on a terminal, or a line every ``every`` steps otherwise (rank 0 only)."""

    def __init__(self, total: int, start: int, every: int, enabled: bool,
                 stream: TextIO | None = None) -> None:
        self.total, self.start, self.every, self.enabled = total, start, max(1, every), enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def update(self, r: StepResult) -> None:
        """Show one finished step."""
        if not self.enabled:
            return
        width = 24
        done = int(width * r.step / self.total)
        text = (f"step {r.step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (width - done)}] "
                f"loss {r.loss:.4f} | {r.tokens_per_s:,.0f} tok/s | {r.seconds * 1000:.0f} ms/step | "
                f"peak {mib(peak_bytes())} MiB")
        if self.tty:
            self.stream.write("\r" + text + ("\n" if r.step == self.total else ""))
        elif r.step == self.total or r.step == self.start + 1 or r.step % self.every == 0:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line if the run stopped early."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def train(engine: Any, batches: Batches, groups: ParallelGroups, *, steps: int, start: int = 0,
          pipeline: bool = False, progress: Progress | None = None,
          before_step: Callable[[int], None] | None = None, on_step: Callable[[int], None] | None = None,
          after_step: Callable[[StepResult], None] | None = None,
          sync_at: Callable[[int], bool] | None = None) -> list[StepResult]:
    """Train from ``start`` optimizer steps done to ``steps``.

    Hooks: ``before_step(s)`` before 0-based step s; ``on_step(n)`` right after the n-th step (the engine
    holds its state: checkpoints go here); ``after_step(result)`` once its loss is known, which is
    after the next step has run (the loss is reduced in the background meanwhile), except for the
    steps n where ``sync_at(n)`` is true: their loss is waited for and reported before ``on_step(n)``
    (a checkpoint's step is then logged before the checkpoint exists, so a run resumed from it
    has the losses of every step it holds).
    """
    seq_tokens = batches.global_batch * batches.source.seq_len
    results: list[StepResult] = []
    run_step = pipeline_step if pipeline else plain_step

    def finish(step: int, loss: PendingLoss, seconds: float) -> None:
        value = loss.value()
        if not math.isfinite(value):
            raise TrainingError(f"the loss is {value} at step {step}; lower training.optimizer.lr or "
                                "enable gradient clipping (training.grad_clip)")
        result = StepResult(step, value, seconds, seq_tokens / seconds)
        results.append(result)
        if progress is not None:
            progress.update(result)
        if after_step is not None:
            after_step(result)

    pending: tuple[int, PendingLoss, float] | None = None
    in_flight: list[PendingLoss] = []
    try:
        for step in range(start, steps):
            if before_step is not None:
                before_step(step)
            t0 = time.perf_counter()
            loss = run_step(engine, batches, step, groups)
            in_flight.append(loss)
            seconds = time.perf_counter() - t0
            if pending is not None:
                finish(*pending)
                in_flight.remove(pending[1])
            pending = (step + 1, loss, seconds)
            if sync_at is not None and sync_at(step + 1):
                finish(*pending)
                in_flight.remove(loss)
                pending = None
            if on_step is not None:
                on_step(step + 1)
        if pending is not None:
            finish(*pending)
            in_flight.remove(pending[1])
    finally:
        for abandoned in in_flight:
            abandoned.settle()
        if progress is not None and (not results or results[-1].step != steps):
            progress.close()
    return results
