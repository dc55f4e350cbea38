"""DeepSpeed's own parser accepts every emitted ds_config with the planned world size, and its
LR schedulers, built from the emitted parameters, follow the job's schedule.

DeepSpeedConfig takes its batch world size from ``mpu.get_data_parallel_world_size()`` only when
``deepspeed.comm.get_rank()`` works (deepspeed/runtime/config.py DeepSpeedConfig.__init__; without a
process group it silently uses 1). No process group is started here: get_rank is patched to the rank
under test and the mpu reports the plan's dp, which is what dsforge.runtime hands DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest

deepspeed = pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig

from dsforge.compiler.emit.ds_config import build_ds_config
from dsforge.compiler.emit.optim import scheduler_section
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.spec.schema import SchedulerSpec
from tests.conftest import EXAMPLES
from tests.test_compile_support import example_plan, variant_plan


class PlanMPU:
    """The part of an mpu DeepSpeedConfig reads: the data-parallel world size."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def parse(cfg: dict[str, Any], dp: int, rank: int) -> DeepSpeedConfig:
    with mock.patch.object(deepspeed.comm, "get_rank", return_value=rank):
        return DeepSpeedConfig(cfg, mpu=PlanMPU(dp))


def accept(plan: Plan) -> None:
    assert plan.degrees is not None
    cfg = build_ds_config(plan)
    for rank in (0, plan.world_size - 1):
        parsed = parse(cfg, plan.degrees.dp, rank)
        assert parsed.world_size == plan.degrees.dp
        assert parsed.train_batch_size == plan.spec.training.global_batch
        assert parsed.gradient_accumulation_steps == plan.grad_accum
        assert parsed.zero_optimization_stage == plan.zero


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_deepspeed_accepts_every_example(name: str) -> None:
    accept(example_plan(name))


VARIANTS = {
    "zero3-fp16-offload-full-recompute": ("llama3-8b-dgx-h100", {
        "parallel": {"zero": 3}, "training": {"precision": "fp16", "recompute": "full",
                                              "optimizer": {"offload": "cpu"}}}),
    "zero2-bf16-adam-linear": ("llama3-8b-dgx-h100", {
        "parallel": {"zero": 2}, "training": {"optimizer": {"name": "adam"},
                                              "scheduler": {"name": "linear", "min_lr": 1.0e-5}}}),
    "zero3-nvme": ("llama3-8b-dgx-h100", {
        "parallel": {"zero": 3}, "training": {"optimizer": {"offload": "nvme"}},
        "deepspeed": {"zero_optimization": {"offload_optimizer": {"nvme_path": "/local_nvme"}}}}),
    # Lion on the CPU accelerator runs only as DeepSpeedCPULion, with offload (FusedLion has no CPU op:
    # DSF522)
    "context-parallel-lion-constant": ("tiny-tp2-dp2", {
        "parallel": {"tp": 1, "cp": 2}, "training": {"optimizer": {"name": "lion", "offload": "cpu"},
                                                      "scheduler": {"name": "constant", "warmup_steps": 0}}}),
    "zero0-sgd": ("tiny-pp2-dp2", {"parallel": {"zero": 0}, "training": {"optimizer": {"name": "sgd"}}}),
}


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_deepspeed_accepts_variants(tmp_path: Path, case: str) -> None:
    base, changes = VARIANTS[case]
    accept(variant_plan(tmp_path, base, changes))


def test_deepspeed_would_reject_the_batch_if_tensor_ranks_counted_as_data_parallel() -> None:
    # What AutoTP without an mpu does (research doc R2): the identity must use the plan's dp, not tp x dp.
    plan = example_plan("tiny-tp2-dp2")
    assert plan.degrees is not None and plan.degrees.tp == 2
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse(build_ds_config(plan), plan.degrees.dp * plan.degrees.tp, 0)


def lrs(section: dict[str, Any], lr: float, steps: int) -> list[float]:
    """The learning rate of each optimizer step under DeepSpeed's scheduler built from ``section``.

    The engine steps the scheduler after each optimizer step, so step k runs with the value the
    scheduler computed for iteration k - 1 (step 0: the value "before it has started").
    """
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = getattr(lr_schedules, section["type"])(opt, **section["params"])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_cosine_warms_up_to_the_peak_and_decays_to_min_lr() -> None:
    section = scheduler_section(SchedulerSpec(name="cosine", warmup_steps=10, min_lr=1e-4), 1e-3, 100)
    assert section is not None
    seq = lrs(section, 1e-3, 102)
    peak = seq.index(max(seq))
    assert seq[0] == 0.0 and max(seq) == pytest.approx(1e-3, rel=1e-3) and peak in (10, 11)
    assert all(a >= b for a, b in zip(seq[peak:], seq[peak + 1:]))
    assert seq[-1] == pytest.approx(1e-4, rel=1e-6)


def test_cosine_without_warmup_starts_flat_at_the_peak() -> None:
    section = scheduler_section(SchedulerSpec(name="cosine", warmup_steps=0), 1e-3, 50)
    assert section is not None
    # DeepSpeed clamps warm-up to 2 steps; warmup_min_ratio 1 keeps them at the peak (0 would give 0, 0.5 lr).
    assert lrs(section, 1e-3, 3)[1:] == pytest.approx([1e-3, 1e-3])


def test_linear_decays_to_min_lr_and_constant_holds_the_peak() -> None:
    lin = scheduler_section(SchedulerSpec(name="linear", warmup_steps=5, min_lr=1e-5), 1e-3, 40)
    assert lin is not None
    seq = lrs(lin, 1e-3, 42)
    assert max(seq) == pytest.approx(1e-3) and seq[-1] == pytest.approx(1e-5)
    const = scheduler_section(SchedulerSpec(name="constant", warmup_steps=4), 1e-3, 40)
    assert const is not None
    assert lrs(const, 1e-3, 12)[5:] == pytest.approx([1e-3] * 7)
