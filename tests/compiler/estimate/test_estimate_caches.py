"""The estimate layer's memos (dsforge/compiler/estimate/memo.py) change no result: over drawn candidates,
every estimate computed right after its neighbours (candidates that differ from it in one field: one layout
field, or the precision, stack, hardware, MoE period or sequence of the job) filled the caches equals the same
estimate computed with every cache empty. A cache key that left out what a result depends on would hand the
target a neighbour's result, so the neighbours are exactly the candidates that would expose it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate import comm, flops
from dsforge.compiler.estimate.memo import clear_caches
from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.estimate.shares import layer_kinds, stage_chunks, stage_share
from dsforge.compiler.estimate.steptime import estimate_step, stage_passes
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.search.bounds import edge_memory_bytes, model_state_bytes, pass_floor_s
from dsforge.compiler.search.engine import _model_seeded
from dsforge.compiler.search.space import Layout, apply_layout, layouts, skeletons

DENSE = """version: 1
model: {{preset: tiny-llama, layers: 8, seq_len: {seq}}}
hardware: {hardware}
stack: {stack}
parallel: {{tp: auto, pp: auto, zero: auto, sequence_parallel: auto,
           pipeline: {{schedule: auto, virtual_stages: auto, partition: parameters}}}}
training: {{global_batch: 16, micro_batch: auto, recompute: auto, precision: {precision}, steps: 10}}
search: {{max_tp: 2}}
"""
MOE = """version: 1
model: {{preset: tiny-mixtral, layers: 4, seq_len: {seq}, moe: {{experts: 4, top_k: 2, every: {every}}}}}
hardware: {hardware}
stack: {stack}
parallel: {{tp: auto, pp: auto, cp: auto, ep: auto, zero: auto, context_parallel: {{kind: auto}}}}
training: {{global_batch: 16, micro_batch: auto, recompute: auto, precision: {precision}, steps: 10}}
search: {{max_tp: 2}}
"""
CPU, GPU = "{preset: cpu-local, gpus_per_node: 8}", "{preset: dgx-h100, nodes: 1}"
BASE = {"seq": 256, "hardware": CPU, "stack": "dsforge", "precision": "fp32", "every": 1}
#: each job's neighbours in the job file: the same candidates under one other value of one of these
VARIANTS = {"precision": "bf16", "stack": "megatron-te", "hardware": GPU, "seq": 512, "every": 2}


def _jobs() -> dict[tuple[str, str], dict[str, Any]]:
    jobs = {}
    for kind, text in (("dense", DENSE), ("moe", MOE)):
        jobs[(kind, "base")] = dict(BASE, text=text)
        for key, value in VARIANTS.items():
            if key != "every" or kind == "moe":
                jobs[(kind, key)] = dict(BASE, text=text, **{key: value})
    return jobs


class Spaces(dict[tuple[str, str], tuple[Any, dict[Layout, None]]]):
    """Each job's spec and candidates (a dict: ordered, and fast to ask for one); short in a failure
    report."""

    def __repr__(self) -> str:
        return f"<{len(self)} candidate spaces>"


@pytest.fixture(scope="module")
def spaces(tmp_path_factory: pytest.TempPathFactory) -> Spaces:
    """Every job of `_jobs` loaded, with its candidates."""
    out = Spaces()
    for (kind, variant), fields in _jobs().items():
        path = Path(tmp_path_factory.mktemp("caches")) / f"{kind}-{variant}.yaml"
        path.write_text(fields["text"].format(**fields), encoding="utf-8")
        job, diags = load_job(path)
        assert job is not None, diags
        model = resolve_model(job.spec.model)
        found = {lay: None for skel in skeletons(job.spec, model, job.spec.hardware.nodes)
                 for lay in layouts(job.spec, model, skel, job.spec.hardware.nodes)}
        assert found, (kind, variant)
        out[(kind, variant)] = (job.spec, found)
    return out


def _resolves(plan: Plan) -> bool:
    return bool(plan.layout_ok and plan.placement is not None and plan.stage_layers and plan.grad_accum)


def _plan(spec: Any, lay: Layout) -> Plan:
    return _model_seeded(apply_layout(spec, lay), resolve_model(spec.model))


def _attempt(fn: Any, plan: Plan) -> str:
    try:
        return repr(fn(plan))
    except Exception as exc:  # noqa: BLE001 - a refusal must be the same refusal with and without caches
        return f"raised {type(exc).__name__}: {exc}"


def _estimates(pp: int) -> dict[str, Any]:
    """Every estimate the search and explain read, each a function of the plan (compared as exact reprs)."""
    out: dict[str, Any] = {
        "edge": edge_memory_bytes,
        "states": lambda plan: (model_state_bytes(plan), model_state_bytes(plan, average=True)),
        "pass floor": lambda plan: (pass_floor_s(plan, "edges"), pass_floor_s(plan)),
        "memory": lambda plan: [dataclasses.astuple(s) for s in estimate_memory(plan).stages],
        "step": estimate_step,
        "flops": lambda plan: (flops.model_flops_per_step(plan), flops.hardware_flops_per_step(plan)),
        "model parallel": comm.model_parallel}
    for s in range(pp):
        out[f"stage {s}"] = lambda plan, s=s: (stage_chunks(plan, s), layer_kinds(plan, s),
                                               stage_share(plan, s, 0.0), stage_passes(plan, s, 1.0e12),
                                               comm.data_parallel(plan, s))
    return out


def _warm(plan: Plan) -> dict[str, str]:
    """Every estimate of `_estimates`, in turn on one plan (its memo and the shared caches filling up)."""
    assert plan.degrees is not None
    return {name: _attempt(fn, plan) for name, fn in _estimates(plan.degrees.pp).items()}


def _cold(spec: Any, lay: Layout, pp: int) -> dict[str, str]:
    """Every estimate of `_estimates`, each on a plan of its own with every cache empty."""
    out = {}
    for name, fn in _estimates(pp).items():
        clear_caches()
        out[name] = _attempt(fn, _plan(spec, lay))
    return out


def _neighbours(spaces: Spaces, job: tuple[str, str], target: Layout) -> list[tuple[Any, Layout]]:
    """The candidates one field away from ``target``: in its job one layout field apart, in the job's variants
    (the base and every variant of the same model) the same layout."""
    spec, found = spaces[job]
    near = [(spec, lay) for lay in found
            if sum(a != b for a, b in zip(dataclasses.astuple(lay), dataclasses.astuple(target))) == 1]
    for other in spaces:
        if other[0] == job[0] and other != job and target in spaces[other][1]:
            near.append((spaces[other][0], target))
    return near


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_warm_caches_give_what_empty_caches_give(spaces: Spaces, data: st.DataObject) -> None:
    job = data.draw(st.sampled_from(sorted(spaces)))
    spec, found = spaces[job]
    pp = data.draw(st.sampled_from(sorted({lay.pp for lay in found})))  # deep pipelines as often as shallow
    target = data.draw(st.sampled_from([lay for lay in found if lay.pp == pp]))
    plan = _plan(spec, target)
    assume(_resolves(plan))
    clear_caches()
    for other_spec, lay in _neighbours(spaces, job, target):
        _warm(_plan(other_spec, lay))
    assert plan.degrees is not None
    warm, cold = _warm(plan), _cold(spec, target, plan.degrees.pp)
    assert not [name for name in warm if warm[name] != cold[name]], (job, target)


def test_a_plan_keeps_its_estimates_and_caches_stay_bounded(spaces: Spaces) -> None:
    """Asked twice, a plan answers from its own memo; every shared cache has a size limit."""
    from dsforge.compiler.estimate import memo

    spec, found = spaces[("moe", "base")]
    lay = next(lay for lay in found if _resolves(_plan(spec, lay)) and lay.pp > 1)
    plan = _plan(spec, lay)
    assert estimate_memory(plan) is estimate_memory(plan)
    first = _warm(plan)
    assert _warm(plan) == first == _warm(_plan(spec, lay))
    assert memo._CACHES and all(c.cache_info().maxsize for c in memo._CACHES)
