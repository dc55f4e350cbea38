"""Stack-specific pipeline splits: Megatron-Core's even split and uneven ends (DSF109, DSF305), per-stage
estimates that follow them, and the gradient dtype each stack reduces in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate import comm
from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.plan.plan import end_stage_partition
from dsforge.compiler.validate import validate_file


def _validate(tmp_path: Path, stack: str, layers: int, pp: int, pipeline: dict[str, Any], name: str = "job",
              precision: str = "fp32", dp: int = 1, zero: int = 0) -> Any:
    job = {"version": 1, "stack": stack, "model": {"preset": "tiny-llama", "layers": layers},
           "hardware": {"preset": "cpu-local", "gpus_per_node": pp * dp},
           "parallel": {"pp": pp, "dp": dp, "zero": zero, "pipeline": pipeline},
           "training": {"global_batch": 16, "precision": precision}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return validate_file(path)


def _rules(result: Any, severity: str = "ERROR") -> list[str]:
    return [d.rule for d in result.diagnostics if d.severity.name == severity]


def test_end_stage_partition_examples() -> None:
    assert end_stage_partition(10, 4, 1, 1, 3) == [1, 3, 3, 3]
    assert end_stage_partition(10, 4, 1, None, 1) == [3, 3, 3, 1]
    # uneven middle: the later stage takes one more
    assert end_stage_partition(10, 4, 1, 1, 2) == [1, 3, 4, 2]
    assert end_stage_partition(12, 2, 2, 4, 8) == [2, 4, 2, 4]  # chunk j*pp + s holds stage s's j-th share
    assert end_stage_partition(4, 2, 1, 4, None) == []  # no layer left for the last stage
    assert end_stage_partition(4, 2, 1, 1, 1) == []  # two layers left but no middle stage
    assert end_stage_partition(4, 1, 1, 4, None) == []  # no pipeline


@given(st.integers(1, 64), st.integers(2, 8), st.integers(1, 3), st.none() | st.integers(1, 20),
       st.none() | st.integers(1, 20))
@settings(max_examples=300, deadline=None)
def test_end_stage_partition_accounts_for_every_layer(layers: int, pp: int, vp: int, first: int | None,
                                                      last: int | None) -> None:
    split = end_stage_partition(layers, pp, vp, first, last)
    if not split:
        return
    assert len(split) == pp * vp and sum(split) == layers and min(split) >= 1
    per_stage = [sum(split[j * pp + s] for j in range(vp)) for s in range(pp)]
    if first is not None:
        assert per_stage[0] == first
    if last is not None:
        assert per_stage[-1] == last
    middle = per_stage[1 if first is not None else 0: pp - 1 if last is not None else pp]
    assert not middle or max(middle) - min(middle) <= 1


def test_uneven_ends_are_estimated_per_stage(tmp_path: Path) -> None:
    pipeline = {"first_stage_layers": 1, "last_stage_layers": 1}
    result = _validate(tmp_path, "megatron-te", 6, 3, pipeline)
    assert not _rules(result), result.diagnostics
    plan = result.plan
    assert plan.stage_layers == [1, 4, 1]
    step, memory = estimate_step(plan), estimate_memory(plan)
    assert step.critical_stage == 1  # the middle stage holds four layers
    fwd = [row[0].compute_s for row in step.forward]
    assert fwd[1] > fwd[0] and fwd[1] > fwd[2]
    acts = [s.components["activations"] for s in memory.stages]
    assert acts[1] > acts[2]  # more layers keep more activations (1F1B: the last stage keeps one micro-batch)


def test_dsforge_builds_the_same_uneven_split(tmp_path: Path) -> None:
    result = _validate(tmp_path, "dsforge", 10, 4, {"first_stage_layers": 1, "last_stage_layers": 2})
    assert result.plan.stage_layers == [1, 3, 4, 2]
    assert _rules(result, "WARNING").count("DSF305") == 1 and "DSF305" not in _rules(result)


@pytest.mark.parametrize(("stack", "layers", "pp", "pipeline", "why"), [
    ("megatron-te", 10, 4, {"first_stage_layers": 1, "last_stage_layers": 2}, "Megatron-Core refuses"),
    ("dsforge", 4, 2, {"first_stage_layers": 1, "partition": [1, 3]}, "only one may give the split"),
    ("dsforge", 4, 1, {"first_stage_layers": 2}, "need a pipeline"),
    ("megatron-te", 4, 2, {"first_stage_layers": 4}, "0 layers remain for 1 middle stage"),
    ("megatron-te", 6, 2, {"first_stage_layers": 2, "last_stage_layers": 2}, "2 layers remain for 0 middle"),
    ("megatron-te", 8, 3, {"first_stage_layers": 7, "last_stage_layers": 3}, "already exceed"),
    ("megatron-te", 12, 2, {"first_stage_layers": 3, "schedule": "interleaved", "virtual_stages": 2},
     "first_stage_layers=3"),
])
def test_dsf305_refuses_splits_the_stack_cannot_build(tmp_path: Path, stack: str, layers: int, pp: int,
                                                       pipeline: dict[str, Any], why: str) -> None:
    result = _validate(tmp_path, stack, layers, pp, pipeline)
    found = [d for d in result.diagnostics if d.rule == "DSF305"]
    assert len(found) == 1 and found[0].severity.name == "ERROR" and why in found[0].message, (
        result.diagnostics
    )
    assert found[0].location.line > 1 and found[0].fix


def test_dsf109_follows_the_stack(tmp_path: Path) -> None:
    # Megatron-Core splits evenly and refuses 6 layers over 4 stages; DeepSpeed balances them
    assert "DSF109" in _rules(_validate(tmp_path, "megatron-te", 6, 4, {}, "m"))
    assert "DSF109" not in _rules(_validate(tmp_path, "dsforge", 6, 4, {}, "d"))
    even = _validate(tmp_path, "megatron-te", 8, 4, {"partition": "parameters"}, "e")
    assert not _rules(even) and even.plan.stage_layers == [2, 2, 2, 2]  # Megatron's split, not DeepSpeed's
    # explicit per-chunk lists are Megatron's pipeline_model_parallel_layout: no DSF109
    assert "DSF109" not in _rules(_validate(tmp_path, "megatron-te", 6, 4, {"partition": [1, 2, 2, 1]}, "l"))


def test_megatron_reduces_gradients_in_fp32(tmp_path: Path) -> None:
    def reduce_bytes(stack: str) -> float:
        plan = _validate(tmp_path, stack, 4, 1, {}, stack, "bf16", dp=2, zero=1).plan
        (rs,) = [o for o in comm.data_parallel(plan, 0) if o.op == "reduce-scatter"]
        (ag,) = [o for o in comm.data_parallel(plan, 0) if o.op == "all-gather"]
        assert ag.sent_bytes > 0
        return rs.sent_bytes / ag.sent_bytes

    assert reduce_bytes("dsforge") == pytest.approx(1.0)  # DeepSpeed: the 16-bit communication_data_type
    assert reduce_bytes("megatron-te") == pytest.approx(2.0)  # fp32 main grads against bf16 parameters
