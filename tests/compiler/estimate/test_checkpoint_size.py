"""explain's checkpoint bytes (dsforge.compiler.estimate.checkpoint_size): the arithmetic, without a run.

tests/runtime_e2e/test_machine_faults.py and test_continue.py compare the figure with real checkpoints
(fp32 ZeRO-0, DP2 ZeRO-1, TP2 ZeRO-0); here the invariants that hold for every layout: dsforge's own
copies hold every parameter once whatever the ZeRO stage and data parallelism, DeepSpeed's files hold
the fp32 master and optimizer state once, and the retention's peak is keep + 1 checkpoints.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsforge.compiler.estimate.checkpoint_size import (
    SMALL_FILES,
    checkpoint_size,
    checkpoint_summary,
    peak_checkpoints,
    saves_of,
)
from dsforge.compiler.frontend.parse import parse_job
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.plan import build_plan


def plan(parallel: dict[str, object], precision: str = "bf16", **checkpoint: object):  # type: ignore[no-untyped-def]
    doc = {"version": 1, "name": "size", "model": {"preset": "tiny-llama"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 4}, "parallel": {"dp": "auto", **parallel},
           "training": {"global_batch": 8, "micro_batch": 1, "precision": precision, "steps": 10,
                        "checkpoint": {"every": 3, **checkpoint}}}
    spec, diags = parse_job(doc, SourceMap("job.yaml"))
    assert spec is not None, [d.message for d in diags]
    return build_plan(spec)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_each_parameter_is_copied_once_whatever_the_zero_stage_and_dp(precision: str) -> None:
    sizes = {name: checkpoint_size(plan(par, precision))
             for name, par in {"dp4-z0": {"zero": 0}, "dp4-z1": {"zero": 1}, "dp4-z3": {"zero": 3}}.items()}
    own = {s.dsforge for s in sizes.values()}
    assert len(own) == 1  # dsforge-weights and dsforge-state: every parameter once
    z0, z1, z3 = sizes["dp4-z0"], sizes["dp4-z1"], sizes["dp4-z3"]
    # In 16 bits ZeRO-1 adds no bytes over ZeRO-0 (the fp32 master moves from the model file into the ranks'
    # optimizer files); in fp32 ZeRO keeps an fp32 partition beside the fp32 weights, 4 bytes a parameter
    # more. ZeRO-3 keeps no weights in DeepSpeed's model files (its partitions are the fp32 master's).
    params = (z0.dsforge - SMALL_FILES) / (4 + 4 + 8 if precision == "fp32" else 2 + 4 + 8)  # AdamW: k = 8
    extra = 4 * params if precision == "fp32" else 0.0
    assert z1.deepspeed == pytest.approx(z0.deepspeed + extra) and z3.deepspeed < z1.deepspeed
    assert z1.per_rank_max < z0.per_rank_max


def test_tensor_parallel_ranks_split_the_bytes() -> None:
    one, tp2 = checkpoint_size(plan({"zero": 0})), checkpoint_size(plan({"tp": 2, "zero": 0}))
    assert tp2.total == pytest.approx(one.total, rel=0.05)  # replicated norms and biases only
    assert tp2.per_rank_max < 0.6 * one.per_rank_max


@given(st.integers(1, 10**6), st.integers(0, 10**6), st.one_of(st.integers(1, 10**6), st.just("all")))
def test_the_retention_peak(steps: int, every: int, keep: int | str) -> None:
    saves = saves_of(steps, every)
    assert 1 <= saves <= steps
    assert saves == (1 if every == 0 else -(-steps // every))
    peak = peak_checkpoints(saves, keep)
    assert peak == (saves if keep == "all" else min(saves, keep + 1))


def test_the_summary_states_the_retention() -> None:
    doc = checkpoint_summary(plan({"zero": 1}, keep=2))
    assert doc["saves"] == 4 and doc["keep"] == 2 and doc["peak_checkpoints"] == 3
    assert doc["bytes_needed"] == 3 * doc["bytes_total"]
    assert checkpoint_summary(plan({"zero": 1}))["peak_checkpoints"] == 4  # keep: all
