"""The training loop: optimizer steps over the job's batches, with loss, tokens/s and memory on rank 0.

A plain engine runs forward / backward / step per micro-batch (DeepSpeed steps the optimizer at the
accumulation boundary); a pipeline engine takes the whole step's micro-batches through
``train_batch``. The logged loss is the global batch's mean next-token loss, the same number a
single process training on the whole global batch would print.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.distributed as dist

from dsforge.runtime.data import Batches
from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.measure import mib, peak_bytes


class TrainingError(RuntimeError):
    """Training cannot go on (the loss is no longer finite); the message says at which step."""


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: its 1-based number, the global mean loss, wall seconds and throughput."""

    step: int
    loss: float
    seconds: float
    tokens_per_s: float


def plain_step(engine: Any, batches: Batches, step: int, groups: ParallelGroups) -> float:
    """One optimizer step of a plain engine (0-based ``step``); the global batch's mean loss."""
    total = torch.zeros(())
    for mb in batches.step(step):
        loss = engine(mb.ids, mb.targets, mb.positions)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float().cpu()
    # Each rank holds its micro-batches' (cp: share of the) mean; sum over dp x cp, average over dp.
    if groups.size("dp-cp") > 1:
        dist.all_reduce(total, group=groups.dp_cp)
    return float(total) / (groups.size("dp") * batches.grad_accum)


def pipeline_step(engine: Any, batches: Batches, step: int, groups: ParallelGroups) -> float:
    """One optimizer step of a pipeline engine; DeepSpeed averages the loss over its data axis (dp x cp)."""
    from dsforge.runtime.engine import pipeline_inputs

    loss = engine.train_batch(data_iter=iter(pipeline_inputs(batches.step(step))))
    return float(loss) * groups.size("cp")  # cp ranks hold shares of one sequence's loss, not replicas


class Progress:
    """A one-line progress bar on a terminal, or a line every ``every`` steps otherwise (rank 0 only)."""

    def __init__(self, total: int, start: int, every: int, enabled: bool, stream: TextIO | None = None) -> None:
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
          before_step: Callable[[int], None] | None = None,
          after_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
    """Train from ``start`` optimizer steps done to ``steps``; ``before_step(s)`` / ``after_step(result)`` hook in."""
    seq_tokens = batches.global_batch * batches.source.seq_len
    results: list[StepResult] = []
    run_step = pipeline_step if pipeline else plain_step
    try:
        for step in range(start, steps):
            if before_step is not None:
                before_step(step)
            t0 = time.perf_counter()
            loss = run_step(engine, batches, step, groups)
            seconds = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise TrainingError(f"the loss is {loss} at step {step + 1}; lower training.optimizer.lr or "
                                    "enable gradient clipping (training.grad_clip)")
            result = StepResult(step + 1, loss, seconds, seq_tokens / seconds)
            results.append(result)
            if progress is not None:
                progress.update(result)
            if after_step is not None:
                after_step(result)
    finally:
        if progress is not None and (not results or results[-1].step != steps):
            progress.close()
    return results
