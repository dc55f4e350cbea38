"""The pruned search ranks exactly as the exhaustive one, and every bound it prunes with lies below the
estimate."""

from __future__ import annotations

import itertools

import pytest

from dsforge.compiler.estimate.memory import estimate_memory, micro_batches, stage_memory
from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.search.bounds import compute_floor_s, edge_memory_bytes, model_state_bytes, pass_floor_s
from dsforge.compiler.search.engine import _model_seeded, search
from dsforge.compiler.search.space import apply_layout, layouts, skeletons

#: Small spaces over the axes that matter: pipelines and their schedules, ZeRO, micro-batches, recompute, SP,
#: CP, EP, the objectives and a deadline.
SPACES = {
    "dense-gpus": """version: 1
model: {preset: llama3-8b, layers: 4}
hardware: {preset: dgx-a100-40gb, nodes: 1}
parallel: {tp: auto, pp: auto, zero: auto, sequence_parallel: true}
training: {global_batch: 16, micro_batch: auto, recompute: auto, steps: 10}
""",
    "pipeline-schedules": """version: 1
model: {preset: tiny-llama, layers: 8}
hardware: {preset: cpu-local, gpus_per_node: 8}
parallel: {tp: auto, pp: auto, zero: 1, pipeline: {schedule: auto, virtual_stages: auto, partition: uniform}}
training: {global_batch: 16, micro_batch: auto, precision: fp32, steps: 10}
search: {objective: time_to_train, top: 8}
""",
    "cp-ep-moe": """version: 1
model: {preset: tiny-mixtral}
hardware: {preset: cpu-local, gpus_per_node: 4}
parallel: {tp: auto, cp: auto, ep: auto, zero: auto, context_parallel: {kind: auto}}
training: {global_batch: 16, micro_batch: auto, precision: fp32, steps: 10}
search: {objective: cost, price_per_gpu_hour: 2.0, top: 6}
""",
    "memory-groups": """version: 1
model: {preset: llama3-8b, layers: 4, seq_len: 8192}
hardware: {preset: dgx-a100-40gb, nodes: 1}
parallel: {tp: auto, pp: auto, zero: auto}
training: {global_batch: 64, micro_batch: auto, recompute: auto, steps: 10}
""",
    "deadline": """version: 1
model: {preset: llama3-8b, layers: 2}
hardware: {preset: dgx-h100, nodes: auto}
parallel: {tp: auto, pp: auto, zero: auto}
training: {global_batch: 64, micro_batch: auto, recompute: selective}
search: {objective: min_gpus, tokens: 2.0e9, deadline_hours: 0.7, max_nodes: 3}
launch: {launcher: slurm}
""",
}


def _job(write_job, text: str):
    job, diags = load_job(write_job(text))
    assert job is not None, diags
    return job


@pytest.mark.parametrize("name", sorted(SPACES))
def test_the_pruned_search_ranks_as_the_exhaustive_one(write_job, name: str) -> None:
    job = _job(write_job, SPACES[name])
    pruned = search(job)
    full = search(job, exhaustive=True)
    top = len(pruned.ranked)
    assert not pruned.exhaustive  # no bound or order check failed (which would repeat it without pruning)
    assert top > 0 and full.funnel.considered == pruned.funnel.considered
    assert [(e.layout, e.value) for e in pruned.ranked] == [(e.layout, e.value) for e in full.ranked[:top]]
    assert pruned.nodes == full.nodes
    # the exhaustive search ranks every fitting candidate, the pruned one estimates fewer of them
    assert full.funnel.fitting == len(full.fitting) >= pruned.funnel.fitting
    assert pruned.funnel.estimated <= full.funnel.estimated


@pytest.mark.parametrize("name", ["dense-gpus", "pipeline-schedules", "cp-ep-moe"])
def test_every_bound_lies_below_what_it_bounds(write_job, name: str) -> None:
    job = _job(write_job, SPACES[name])
    model = resolve_model(job.spec.model)
    checked = 0
    for skel in skeletons(job.spec, model, job.spec.hardware.nodes):
        for lay in layouts(job.spec, model, skel, job.spec.hardware.nodes):
            plan = _model_seeded(apply_layout(job.spec, lay), model)
            if (
                not plan.layout_ok
                or plan.placement is None
                or not plan.stage_layers
                or plan.grad_accum is None
            ):
                continue
            est = estimate_memory(plan)
            peak = est.peak.device_bytes
            # stages alike are estimated once (estimate.memory._stage_class): each as estimated on its own
            z, m = zero_settings(plan), micro_batches(plan)
            assert [(x.stage, x.rank, x.components, x.host, x.phase, x.moments) for x in est.stages] == [
                (x.stage, x.rank, x.components, x.host, x.phase, x.moments)
                for x in (stage_memory(plan, st, z, m) for st in range(plan.degrees.pp))], lay
            assert estimate_memory(plan) is est  # asked again (the rules do), the plan's own
            assert model_state_bytes(plan, average=True) <= model_state_bytes(plan) <= peak
            assert edge_memory_bytes(plan) <= peak
            step = estimate_step(plan).step_s
            assert compute_floor_s(plan) <= step * (1 + 1e-9), lay
            assert pass_floor_s(plan, "edges") <= pass_floor_s(plan) <= step * (1 + 1e-9), lay
            assert pass_floor_s(plan) == pass_floor_s(plan, "each"), lay  # alike stages priced once
            checked += 1
    assert checked >= 20


def test_ties_go_to_less_model_parallelism(write_job) -> None:
    # tiny on CPU processes: many layouts tie within the cost model's precision only when equal; the tiebreak
    # orders equal values by tp x pp x cp first
    job = _job(write_job, SPACES["pipeline-schedules"])
    ranked = search(job, exhaustive=True).ranked
    for a, b in itertools.pairwise(ranked):
        assert a.value < b.value or (a.value == b.value and a.layout.tiebreak() <= b.layout.tiebreak())


def test_min_gpus_picks_the_fewest_nodes_that_meet_the_deadline(write_job) -> None:
    job = _job(write_job, SPACES["deadline"])
    r = search(job)
    assert r.winner is not None and r.nodes == r.nodes_tried[-1]
    deadline = r.objective.deadline_s
    assert deadline is not None and r.winner.value <= deadline
    if r.nodes > 1:  # one node fewer misses it with every layout
        fewer = _job(write_job, SPACES["deadline"].replace("max_nodes: 3", f"max_nodes: {r.nodes - 1}"))
        assert search(fewer).winner is None


def test_a_bound_above_the_estimate_makes_the_search_exhaustive(write_job, monkeypatch) -> None:
    from dsforge.compiler.search import engine

    job = _job(write_job, SPACES["pipeline-schedules"])
    honest = search(job)
    monkeypatch.setattr(engine, "pass_floor_s", lambda plan, stages="all": 1e9)  # a broken bound
    r = search(job)
    assert r.exhaustive and [e.layout for e in r.ranked] == [e.layout for e in honest.ranked]


LARGE = ["llama3-8b-dgx-h100.yaml", "llama3-70b-multinode.yaml", "mixtral-8x7b-ep.yaml",
         "gpt3-175b-cluster.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_each_large_example_with_auto_degrees_gets_a_layout_at_least_as_fast_as_its_own(name: str) -> None:
    from dsforge.commands.search import DEGREES, all_auto
    from dsforge.compiler.search.space import written_layout
    from tests.conftest import ROOT

    job, _ = load_job(ROOT / "examples" / name)
    assert job is not None
    written = written_layout(job.spec)
    r = search(job, compare=written, spec=all_auto(job.spec, DEGREES))
    assert r.winner is not None and r.written is not None, r.written_miss
    assert r.winner.memory.utilization <= 0.9 and r.winner.value <= r.written.value
    assert r.written_rank is not None and r.written_rank >= 1
    print(f"{name}: winner {r.winner.layout.label()} {r.winner.step.step_s:.2f} s/step; written "
          f"{written.label()} {r.written.step.step_s:.2f} s/step, rank {r.written_rank} of "
          f"{r.funnel.fitting} estimated ({r.seconds:.1f} s)")


@pytest.mark.parametrize("name", ["dense-gpus", "pipeline-schedules", "memory-groups"])
def test_the_memory_bound_grows_with_the_micro_batch_and_less_recompute(write_job, name: str) -> None:
    """The order `_staircase` relies on, over every member of every memory group: with two or more
    micro-batches a larger micro-batch or less recomputation never lowers the bound; with one, less
    recomputation never does."""
    job = _job(write_job, SPACES[name])
    model = resolve_model(job.spec.model)
    order = {"full": 0, "selective": 1, "none": 2}
    pairs = 0
    for skel in skeletons(job.spec, model, job.spec.hardware.nodes):
        groups: dict[tuple, list] = {}
        for lay in layouts(job.spec, model, skel, job.spec.hardware.nodes):
            key = (lay.sequence_parallel, lay.cp_kind, lay.schedule, lay.virtual_stages, lay.global_batch)
            bound = edge_memory_bytes(_model_seeded(apply_layout(job.spec, lay), model))
            groups.setdefault(key, []).append((lay, bound))
        for members in groups.values():
            for (a, ba), (b, bb) in itertools.permutations(members, 2):
                single_a = a.global_batch // (a.dp * a.micro_batch) == 1
                single_b = b.global_batch // (b.dp * b.micro_batch) == 1
                if single_a != single_b or (single_a and a.micro_batch != b.micro_batch):
                    continue
                if a.micro_batch <= b.micro_batch and order[a.recompute] <= order[b.recompute]:
                    assert ba <= bb * (1 + 1e-9), (a, b)
                    pairs += 1
    assert pairs >= 20


def test_the_memory_staircase_bounds_fewer_candidates_than_it_rules_out(write_job) -> None:
    job = _job(write_job, SPACES["memory-groups"])
    pruned, full = search(job), search(job, exhaustive=True)
    assert not pruned.exhaustive
    assert [(e.layout, e.value) for e in pruned.ranked] == [
        (e.layout, e.value) for e in full.ranked[: len(pruned.ranked)]
    ]
    removed = pruned.funnel.removed["memory"] + pruned.funnel.removed["DSF301"]
    assert removed > 0 and pruned.funnel.bounded < pruned.funnel.considered
