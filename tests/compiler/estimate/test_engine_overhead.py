"""The DeepSpeed engine's host work in the step model: the tensor count, the fit of calibrate's rows, the
estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.engine_overhead import engine_overhead, rank_tensors
from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.validate import validate_file
from dsforge.runtime.calibrate.fits import fit_engine
from dsforge.runtime.models import build_model

COST = {"step_us": [1000.0, 2000.0, 3000.0, 4000.0], "micro_batch_us": [100.0, 200.0, 300.0, 400.0],
        "tensor_step_us": [10.0, 20.0, 30.0, 40.0], "tensor_micro_batch_us": [1.0, 2.0, 3.0, 4.0]}


def _plan(tmp_path: Path, name: str, model: dict[str, Any], parallel: dict[str, Any], ranks: int = 1,
          hardware: dict[str, Any] | None = None, stack: str = "dsforge", global_batch: int = 4) -> Any:
    job = {"version": 1, "stack": stack, "model": model,
           "hardware": {"preset": "cpu-local", "gpus_per_node": ranks, **(hardware or {})},
           "parallel": parallel,
           "training": {"global_batch": global_batch, "micro_batch": 1, "precision": "fp32"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    result = validate_file(path)
    assert result.plan is not None, result.diagnostics
    return result.plan


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_rank_tensors_counts_the_parameters_of_the_built_model(tmp_path: Path, preset: str) -> None:
    # (MoE layers are counted per expert, as DeepSpeed's MoE layer holds them, not HF's fused expert tensors)
    plan = _plan(tmp_path, preset, {"preset": preset}, {"dp": 1})
    module = build_model(plan.model, device="meta")
    assert rank_tensors(plan, 0) == sum(1 for _ in module.parameters())


def test_rank_tensors_split_over_pipeline_stages(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "pp", {"preset": "tiny-llama"},
                 {"pp": 2, "dp": 1, "pipeline": {"partition": "uniform"}}, ranks=2)
    # 2 layers of 9 tensors each; the first stage has the embedding, the last the final norm and the head
    assert (rank_tensors(plan, 0), rank_tensors(plan, 1)) == (19, 20)


@given(st.lists(st.floats(0, 5e3), min_size=4, max_size=4), st.integers(0, 3), st.integers(5, 60))
@settings(max_examples=50, deadline=None)
def test_fit_engine_recovers_the_terms(terms: list[float], zero: int, t0: int) -> None:
    micro, tensor_micro, step, tensor_step = terms
    rows = []
    for z in range(4):
        for tensors in (t0, 3 * t0):
            bare = 0.01 * tensors
            mb = bare + (micro + tensors * tensor_micro) * 1e-6 * (z == zero)
            last = mb + (step + tensors * tensor_step) * 1e-6 * (z == zero)
            rows.append({"zero": z, "layers": tensors, "tensors": tensors, "bare_s": bare,
                         "micro_batch_s": mb, "last_micro_batch_s": last})
    fit = fit_engine(rows)
    got = [fit["micro_batch_us"][zero], fit["tensor_micro_batch_us"][zero], fit["step_us"][zero],
           fit["tensor_step_us"][zero]]
    assert got == pytest.approx(terms, abs=0.02)
    assert all(fit[k][z] == pytest.approx(0.0, abs=1e-3) for k in fit for z in range(4) if z != zero)


def test_a_negative_slope_is_noise_not_a_negative_cost() -> None:
    rows = [{"zero": z, "layers": t, "tensors": t, "bare_s": 0.0, "micro_batch_s": y, "last_micro_batch_s": y}
            for z in range(4) for t, y in ((20, 0.003), (80, 0.001))]
    fit = fit_engine(rows)
    assert fit["tensor_micro_batch_us"] == [0.0] * 4 and fit["micro_batch_us"] == [2000.0] * 4


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_step_pays_the_engine_per_micro_batch_tensor_and_step(tmp_path: Path, zero: int) -> None:
    model, parallel = {"preset": "tiny-llama"}, {"dp": 1, "zero": zero}
    bare = estimate_step(_plan(tmp_path, f"bare{zero}", model, parallel))
    plan = _plan(tmp_path, f"cost{zero}", model, parallel, hardware={"engine_overhead": COST})
    priced = estimate_step(plan)
    tensors, m = 39, 4  # 4 layers x 9 + embedding, final norm, head; global batch 4 of micro-batch 1
    assert rank_tensors(plan, 0) == tensors
    want = (m * (COST["micro_batch_us"][zero] + tensors * COST["tensor_micro_batch_us"][zero])
            + COST["step_us"][zero] + tensors * COST["tensor_step_us"][zero]) * 1e-6
    assert priced.engine_s == pytest.approx(want)
    assert priced.step_s - bare.step_s == pytest.approx(want)
    assert bare.engine_s == 0.0


def test_pipeline_stages_pay_their_own_tensors_and_the_bubble_follows(tmp_path: Path) -> None:
    parallel = {"pp": 2, "dp": 1, "zero": 0, "pipeline": {"partition": "uniform"}}
    plan = _plan(tmp_path, "pp", {"preset": "tiny-llama"}, parallel, ranks=2,
                 hardware={"engine_overhead": COST})
    first, last = engine_overhead(plan, 0), engine_overhead(plan, 1)
    assert last.micro_batch_s - first.micro_batch_s == pytest.approx(
        1 * COST["tensor_micro_batch_us"][0] * 1e-6
    )
    step = estimate_step(plan)
    # each stage's passes carry their micro-batch share; the critical rank adds its per-step term once
    passes = [x.engine_s for row in (step.forward[1], step.backward[1]) for x in row]
    assert sum(passes) == pytest.approx(last.micro_batch_s)


def test_other_stacks_run_no_deepspeed_engine(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "mega", {"preset": "tiny-llama"}, {"dp": 1}, hardware={"engine_overhead": COST},
                 stack="megatron-te")
    assert engine_overhead(plan, 0).micro_batch_s == 0.0 and estimate_step(plan).engine_s == 0.0


def test_engine_overhead_needs_four_figures(tmp_path: Path) -> None:
    job = {"version": 1, "model": {"preset": "tiny-llama"}, "parallel": {"dp": 1},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 1,
                        "engine_overhead": {"step_us": [1.0, 2.0]}},
           "training": {"global_batch": 4}}
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    result = validate_file(path)
    errors = [d for d in result.diagnostics if d.severity.name == "ERROR"]
    assert errors and "engine_overhead" in ".".join(map(str, errors[0].path)) and errors[0].location.line > 0
