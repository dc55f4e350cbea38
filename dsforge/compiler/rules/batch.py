"""DSF2xx: batch arithmetic, the pipeline schedule and the training loop settings."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.plan.bubble import bubble_fraction
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors, next_multiple
from dsforge.diagnostics import Severity

#: Above this idle fraction the pipeline bubble is reported (a rule of thumb, not a DeepSpeed limit).
BUBBLE_WARN = 0.25


@rule("DSF201", "global_batch = micro_batch x dp x accumulation",
      source="deepspeed/runtime/config.py DeepSpeedConfig._batch_assertion")
def batch_identity(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed asserts train_batch_size == micro_batch_per_gpu x gradient_accumulation_steps x dp and
    fails every rank at start-up otherwise; the accumulation steps must be a whole number."""
    d, t = ctx.plan.degrees, ctx.spec.training
    if d is None or not ctx.plan.layout_ok:
        return  # dp is not settled while the degrees do not fill the world (DSF101/DSF102)
    per_step = t.micro_batch * d.dp
    if t.global_batch % per_step == 0:
        return
    below = t.global_batch // per_step * per_step
    batches = [str(b) for b in (below, next_multiple(t.global_batch, per_step)) if b > 0]
    micro = [b for b in divisors(t.global_batch) if (t.global_batch // b) % d.dp == 0][:8]
    fix = f"use global_batch {' or '.join(batches)}" + (
        f", or micro_batch in {choices(micro)}" if micro else ""
    )
    yield Finding(f"global_batch={t.global_batch} is not a multiple of micro_batch*dp = "
                  f"{t.micro_batch}*{d.dp} = {per_step}: gradient accumulation steps would be "
                  f"{t.global_batch}/{per_step}, not a whole number", fix, ("training", "global_batch"))


@rule("DSF202", "micro-batches per step >= pp", severity=Severity.WARNING,
      source="Narayanan et al. 2021 sec. 2.2 (1F1B warm-up); "
             "deepspeed/runtime/pipe/schedule.py TrainSchedule")
def enough_micro_batches(ctx: Context) -> Iterator[Finding]:
    """With fewer micro-batches than stages the pipeline never fills: at any moment some stage has no
    work and at least half of the step is bubble, (p-1)/(m+p-1). DeepSpeed's TrainSchedule still runs
    it, so this is a warning; it is almost always a global_batch chosen for a job without pipelining."""
    d, m = ctx.plan.degrees, ctx.plan.grad_accum
    if d is None or m is None or not ctx.plan.layout_ok or d.pp == 1 or m >= d.pp:
        return
    t = ctx.spec.training
    need = d.pp * t.micro_batch * d.dp
    yield Finding(f"{m} micro-batch(es) per step for pp={d.pp} stages: the pipeline never fills and "
                  f"{bubble_fraction(d.pp, m):.0%} of each step is bubble",
                  f"raise global_batch to >= {need} (pp*micro_batch*dp), or lower micro_batch",
                  ("training", "global_batch"))


@rule("DSF203", "the interleaved schedule's constraints hold",
      source="Narayanan et al. 2021 sec. 2.2.1; Megatron-LM schedules.py (num_microbatches % pp)")
def interleaved_constraints(ctx: Context) -> Iterator[Finding]:
    """Interleaving needs more than one chunk per rank and more than one stage, and Megatron's interleaved
    1F1B requires the micro-batch count to be a multiple of pp; virtual_stages > 1 only means something
    under the interleaved schedule."""
    d, pipe = ctx.plan.degrees, ctx.spec.parallel.pipeline
    if d is None or not ctx.plan.layout_ok:
        return
    path = ("parallel", "pipeline", "virtual_stages")
    if pipe.schedule != "interleaved":
        if pipe.virtual_stages > 1:
            yield Finding(f"virtual_stages={pipe.virtual_stages} but schedule is {pipe.schedule}: "
                          "only the interleaved schedule runs several chunks per rank",
                          "set schedule: interleaved, or virtual_stages: 1", path)
        return
    if d.pp == 1:
        yield Finding("the interleaved schedule needs pp > 1", "set pp > 1, or schedule: 1f1b",
                      ("parallel", "pipeline", "schedule"))
    if pipe.virtual_stages < 2:
        yield Finding("the interleaved schedule needs virtual_stages >= 2", "set virtual_stages: 2 or more",
                      path)
    m = ctx.plan.grad_accum
    if m is not None and d.pp > 1 and m % d.pp:
        yield Finding(f"the interleaved schedule needs micro-batches "
                      f"per step ({m}) to be a multiple of pp={d.pp}",
                      f"use global_batch = {next_multiple(m, d.pp)} x micro_batch x dp",
                      ("training", "global_batch"))


@rule("DSF204", "the pipeline bubble is small", severity=Severity.WARNING,
      source="Narayanan et al. 2021 sec. 2.2: bubble (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1)")
def bubble_small(ctx: Context) -> Iterator[Finding]:
    """A pipeline idles (p-1)/(m+p-1) of each step while it fills and drains; above a quarter of the step
    the layout wastes more than it gains, and more micro-batches (or interleaving) shrink it."""
    d, m = ctx.plan.degrees, ctx.plan.grad_accum
    if d is None or m is None or not ctx.plan.layout_ok or d.pp == 1 or m < d.pp:
        return
    v = (
        ctx.spec.parallel.pipeline.virtual_stages
        if ctx.spec.parallel.pipeline.schedule == "interleaved"
        else 1
    )
    frac = bubble_fraction(d.pp, m, v)
    if frac > BUBBLE_WARN:
        target = -(-(d.pp - 1) * (1 - BUBBLE_WARN) // (BUBBLE_WARN * v))
        yield Finding(f"pipeline bubble is {frac:.0%} of each step (p={d.pp}, m={m}"
                      + (f", v={v}" if v > 1 else "") + ")",
                      f"use >= {int(target)} micro-batches per step (raise global_batch), the interleaved "
                      "schedule, or a smaller pp", ("parallel", "pp"), details={"bubble": frac})


@rule("DSF205", "token data needs a path", source="dsforge")
def token_data_path(ctx: Context) -> Iterator[Finding]:
    """`data.kind: tokens` reads a flat token file; without a path there is nothing to read."""
    data = ctx.spec.training.data
    if data.kind == "tokens" and not data.path:
        yield Finding("training.data.kind is tokens but no path is given", "add `path:` to the token file",
                      ("training", "data"))
    elif data.kind == "tokens" and not isinstance(data.path, str):
        yield Finding("training.data.kind is tokens but path is a list; a token file is one file",
                      "give one path (lists of paths are for kind: megatron blends)",
                      ("training", "data", "path"))


@rule("DSF206", "warm-up and checkpoint intervals fit in the run", severity=Severity.WARNING,
      source="dsforge")
def schedule_lengths(ctx: Context) -> Iterator[Finding]:
    """A warm-up longer than the run never reaches the peak learning rate, and a checkpoint interval
    longer than the run saves only at the end."""
    t = ctx.spec.training
    if t.scheduler.warmup_steps > t.steps:
        yield Finding(f"warmup_steps={t.scheduler.warmup_steps} exceeds "
                      f"steps={t.steps}: the peak lr is never reached",
                      f"use warmup_steps < {t.steps}", ("training", "scheduler", "warmup_steps"))
    if t.checkpoint.every > t.steps:
        yield Finding(f"checkpoint.every={t.checkpoint.every} exceeds "
                      f"steps={t.steps}: only the final save happens",
                      f"use every <= {t.steps}", ("training", "checkpoint", "every"))
