"""The estimate sizes the DeepSpeed settings the emitter writes: one module (ds_settings) feeds both."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.deepspeed.ds_settings import emitted_checkpointing_block, emitted_zero_block, on_cpu
from dsforge.compiler.emit.ds_config import build_ds_config
from dsforge.compiler.estimate.memory import (
    CPU_RESERVE_BYTES,
    GPU_RESERVE_BYTES,
    estimate_memory,
    partitions_checkpoints,
)
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import JobSpec
from tests.test_compile_support import example_plan

BASE = example_plan("tiny-tp2-dp2").spec  # 4 CPU ranks, tp 2, global batch 8, micro-batch 2


def _with(spec: JobSpec, section: str, **values: Any) -> JobSpec:
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def variant(zero: int = 1, tp: int = 2, recompute: str = "none", offload: str = "none",
            accelerator: str = "cpu", deepspeed: dict[str, Any] | None = None) -> Plan:
    """The tiny example with the given knobs (dp follows the world size)."""
    spec = _with(_with(BASE, "parallel", zero=zero, tp=tp), "training", recompute=recompute,
                 optimizer=BASE.training.optimizer.model_copy(update={"offload": offload}))
    hw = BASE.hardware
    spec = spec.model_copy(
        update={
            "hardware": hw.model_copy(
                update={"accelerator": hw.accelerator.model_copy(update={"name": accelerator})}
            ),
            "deepspeed": deepspeed or {},
        }
    )
    return build_plan(spec)


ZERO_OVERRIDES = st.fixed_dictionaries({}, optional={
    "reduce_bucket_size": st.integers(1, 10**9), "overlap_comm": st.booleans(),
    "contiguous_gradients": st.booleans(), "stage3_param_persistence_threshold": st.integers(0, 10**6),
    "offload_optimizer": st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu"])})})
OVERRIDES = st.fixed_dictionaries({}, optional={
    "zero_optimization": ZERO_OVERRIDES,
    "activation_checkpointing": st.fixed_dictionaries({}, optional={"partition_activations": st.booleans()})})


@settings(max_examples=80, deadline=None)
@given(zero=st.integers(0, 3), tp=st.sampled_from([1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]), offload=st.sampled_from(["none", "cpu"]),
       accelerator=st.sampled_from(["cpu", "H100-SXM5-80GB"]), overrides=OVERRIDES)
def test_the_estimate_reads_the_blocks_the_emitter_writes(zero: int, tp: int, recompute: str, offload: str,
                                                          accelerator: str,
                                                          overrides: dict[str, Any]) -> None:
    plan = variant(zero, tp, recompute, offload, accelerator, overrides)
    cfg = build_ds_config(plan)
    assert emitted_zero_block(plan) == cfg["zero_optimization"]
    assert emitted_checkpointing_block(plan) == cfg.get("activation_checkpointing", {})
    z, zo = zero_settings(plan), cfg["zero_optimization"]
    assert z.stage == zo["stage"] == zero and z.pipeline is False
    assert z.reduce_bucket == zo.get("reduce_bucket_size", 5e8)
    assert z.overlap_comm == zo.get("overlap_comm", zero == 3)
    assert z.contiguous_gradients == zo.get("contiguous_gradients", True)
    assert z.persistence_threshold == zo.get("stage3_param_persistence_threshold", 1e5)
    assert partitions_checkpoints(plan) == (tp > 1 and cfg.get("activation_checkpointing", {}).get(
        "partition_activations", False))


@pytest.mark.parametrize(("name", "cpu"), [("cpu", True), ("CPU", True), ("Grace-cpu-GH", False),
                                           ("H100-SXM5-80GB", False)])
def test_one_cpu_test_decides_the_emitted_config_and_the_reserve(name: str, cpu: bool) -> None:
    # a GPU whose name merely contains "cpu" runs on nccl with overlap_comm, so it is estimated as a GPU
    plan = variant(accelerator=name)
    assert on_cpu(plan) is cpu
    cfg = build_ds_config(plan)
    assert cfg["zero_optimization"]["overlap_comm"] is not cpu
    assert cfg["optimizer"]["params"].get("torch_adam", False) is cpu
    reserve = estimate_memory(plan).peak.components["reserve"]
    assert reserve == CPU_RESERVE_BYTES if cpu else reserve >= GPU_RESERVE_BYTES
