"""The search's tighter step-time bounds lie below the estimate on whole small spaces: the pass floor (the
estimate's own passes, transfers and rank 0's tail) and the per-micro-batch data-parallel floor of ZeRO-2/3,
which one computation serves for a whole degree combination."""

from __future__ import annotations

from collections import defaultdict

import pytest

from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.search.bounds import compute_floor_s, micro_batch_dp_s, pass_floor_s
from tests.search_candidates import candidates

SPACES = {
    # GPUs over two nodes: ZeRO-2/3 gathers and reductions on NVLink and the network, TP, CP, SP, pipelines
    "gpus": """version: 1
model: {preset: llama3-8b, layers: 4, seq_len: 2048}
hardware: {preset: dgx-a100-40gb, nodes: 2}
parallel: {tp: auto, pp: auto, cp: auto, zero: auto, sequence_parallel: auto}
training: {global_batch: 32, micro_batch: auto, recompute: auto, steps: 10}
launch: {launcher: slurm}
""",
    # experts over their own data-parallel groups (edp), ZeRO-2 written with pipelines refused elsewhere
    "moe": """version: 1
model: {preset: tiny-mixtral}
hardware: {preset: cpu-local, gpus_per_node: 8}
parallel: {tp: auto, pp: 1, cp: auto, ep: auto, zero: auto}
training: {global_batch: 16, micro_batch: auto, recompute: auto, precision: fp32, steps: 10}
""",
}


def _plans(write_job, text: str):
    for _, lay, plan in candidates(write_job, text):
        if plan.layout_ok and plan.placement is not None and plan.stage_layers and plan.grad_accum:
            yield lay, plan


@pytest.mark.parametrize("name", sorted(SPACES))
def test_the_data_parallel_floor_lies_below_the_step_and_is_one_per_degree_combination(
    write_job, name: str
) -> None:
    per_class: dict[tuple, set[float]] = defaultdict(set)
    tighter = checked = 0
    for lay, plan in _plans(write_job, SPACES[name]):
        if lay.zero < 2:
            assert micro_batch_dp_s(plan) == 0.0  # ZeRO 0-1 reduce once per step, in the tail
            continue
        floor = plan.grad_accum * micro_batch_dp_s(plan)
        step = estimate_step(plan).step_s
        assert 0 < floor <= step * (1 + 1e-9), lay
        tighter += floor > compute_floor_s(plan)
        per_class[(lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.zero,
                   lay.virtual_stages)].add(micro_batch_dp_s(plan))
        checked += 1
    assert checked >= 40 and tighter > 0
    assert all(len(v) == 1 for v in per_class.values()), per_class  # the engine computes it once per class


def test_the_pass_floor_is_the_step_without_a_pipeline(write_job) -> None:
    """One stage: the floor is the estimate's passes back to back plus its tail, the step itself (what makes
    the search estimate only the candidates that rank); with pipelines it stays below the simulated step."""
    exact = piped = 0
    text = SPACES["gpus"].replace("cp: auto, zero: auto, sequence_parallel: auto", "zero: auto")
    for lay, plan in _plans(write_job, text):
        step = estimate_step(plan).step_s
        floor = pass_floor_s(plan)
        assert floor <= step * (1 + 1e-9), lay
        if lay.pp == 1:
            assert floor == pytest.approx(step, rel=1e-9), lay
            exact += 1
        else:
            assert pass_floor_s(plan, "edges") <= floor
            piped += 1
    assert exact >= 20 and piped >= 20


def test_model_states_by_classes_of_alike_stages_equal_every_stage_on_its_own(write_job) -> None:
    """`model_state_bytes` prices one stage per class of alike ones (`bounds.stage_classes`): the busiest
    stage is the same as over every stage, the mean the same up to rounding, with MoE layers every other
    layer, uneven and interleaved splits."""
    from dsforge.compiler.estimate.shares import stage_share
    from dsforge.compiler.search.bounds import model_state_bytes, stage_classes

    text = """version: 1
model: {preset: tiny-mixtral, layers: 10, moe: {experts: 4, top_k: 2, ffn_hidden: 128, every: 2}}
hardware: {preset: cpu-local, gpus_per_node: 8}
parallel: {tp: auto, pp: auto, ep: auto, zero: auto, pipeline: {schedule: auto, virtual_stages: auto}}
training: {global_batch: 16, precision: fp32, steps: 10}
"""
    seen = set()
    for lay, plan in _plans(write_job, text):
        d = plan.degrees
        classes = stage_classes(plan.model, tuple(plan.stage_layers), d.pp)
        assert sum(n for _, n in classes) == d.pp
        shares = [stage_share(plan, s, 0.0) for s in range(d.pp)]
        assert len({(s.total, s.dense, s.expert) for s in shares}) <= len(classes), lay
        per_stage = []
        for share in shares:
            part = (
                share.total
                if lay.zero == 0
                else share.dense / (d.dp * d.cp) + share.expert / max(1, d.expert_dp)
            )
            # fp32 weights, Adam moments
            per_stage.append(4 * (part if lay.zero == 3 else share.total) + 8 * part)
        assert model_state_bytes(plan) == max(per_stage), lay
        assert model_state_bytes(plan, average=True) == pytest.approx(sum(per_stage) / d.pp, rel=1e-12), lay
        seen.add((d.pp, lay.virtual_stages, len(classes)))
    assert any(pp >= 4 and n < pp for pp, _, n in seen) and any(v > 1 for _, v, _ in seen), seen
