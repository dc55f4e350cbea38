"""Process groups: every rank's groups are the plan's, and DeepSpeed's mpu, pipeline topology and expert
groups agree with them.

Three tiers: DeepSpeed's topology arithmetic (pure), a fake process group (torch's fake backend:
group wiring of a 16-rank layout checked for every rank in one process), and real gloo runs on 4
processes, where a group's membership is proved by an all-gather over it and DeepSpeed builds its
own pipeline grid, MoE expert groups and ZeRO engine from dsforge's adapters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.placement import Placement, place
from dsforge.compiler.plan.plan import build_plan
from dsforge.runtime.groups import (
    KINDS,
    LayoutError,
    check_world_size,
    create_groups,
    ensure_deepspeed_comm,
    pipe_topology,
)
from tests.runtime.launcher import run

ROOT = Path(__file__).resolve().parents[2]

# (tp, pp, dp, cp, ep, order): default Megatron order, orders that move tp/dp/pp, cp and ep in play.
LAYOUTS = [
    (2, 2, 2, 2, 2, "tp-cp-ep-dp-pp"),
    (2, 2, 4, 1, 2, "tp-cp-dp-ep-pp"),
    (2, 2, 2, 1, 1, "dp-tp-pp"),
    (2, 2, 2, 1, 1, "pp-dp-tp"),
    (1, 2, 2, 4, 4, "cp-ep-dp-tp-pp"),
    (4, 1, 4, 1, 4, "tp-ep-dp-cp-pp"),
]


def _placement(layout: tuple[int, int, int, int, int, str]) -> Placement:
    tp, pp, dp, cp, ep, order = layout
    return place(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, gpus_per_node=8, order=order)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[5]}:{'x'.join(map(str, x[:5]))}")
def test_pipe_topology_agrees_with_plan_rank_by_rank(layout: tuple[int, int, int, int, int, str]) -> None:
    placement = _placement(layout)
    topo = pipe_topology(placement)  # raises if any DeepSpeed axis group differs from the plan's
    for rank in range(placement.world_size):
        coord, want = topo.get_coord(rank), placement.coordinates(rank)
        assert (coord.pipe, coord.data, coord.model) == (want["pp"], want["dp-cp"], want["tp"]), rank


def test_pipe_topology_rejects_cp_split_from_dp() -> None:
    # ep = cp keeps the expert grid's pipeline groups the dense ones, so place() (Megatron) accepts pp there
    placement = place(tp=1, pp=2, dp=2, cp=2, ep=2, gpus_per_node=8, order="cp-ep-pp-dp-tp")
    with pytest.raises(LayoutError, match="puts pp between cp and dp"):
        pipe_topology(placement)


def test_world_size_mismatch_is_a_clear_error() -> None:
    placement = place(tp=2, pp=2, dp=1, cp=1, ep=1, gpus_per_node=4)
    with pytest.raises(LayoutError, match=r"places 4 ranks \(tp=2 x cp=1 x dp=1 x pp=2\) but 3 processes"):
        check_world_size(placement, launched=3)
    check_world_size(placement, launched=4)


def _fake_world(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@pytest.mark.parametrize("layout", LAYOUTS[:2] + LAYOUTS[4:], ids=lambda x: x[5])
def test_every_rank_gets_the_plans_groups_fake_pg(layout: tuple[int, int, int, int, int, str]) -> None:
    placement = _placement(layout)
    for rank in range(placement.world_size):
        _fake_world(rank, placement.world_size)
        try:
            g = create_groups(placement)
            mpu = g.mpu()
            for kind in KINDS:
                assert dist.get_process_group_ranks(g.group(kind)) == placement.group_of(kind, rank), (
                    rank,
                    kind,
                )
            c = placement.coordinates(rank)
            assert (mpu.get_tensor_model_parallel_rank(), mpu.get_pipe_parallel_rank(),
                    mpu.get_data_parallel_rank(), mpu.get_sequence_parallel_rank(),
                    mpu.get_sequence_data_parallel_rank()) == (c["tp"], c["pp"], c["dp"], c["cp"], c["dp-cp"])
            assert mpu.get_data_parallel_world_size() == layout[2]
            assert mpu.get_model_parallel_world_size() == layout[0] * layout[1]
            assert mpu.get_data_parallel_group_ranks() == placement.group_of("dp", rank)
        finally:
            dist.destroy_process_group()


def test_create_groups_from_an_example_plan_and_refuses_an_unplaced_one() -> None:
    loaded, _ = load_job(ROOT / "examples" / "tiny-3d.yaml")
    assert loaded is not None
    plan = build_plan(loaded.spec)
    _fake_world(5, plan.world_size)
    try:
        g = create_groups(plan)
        assert g.ranks("tp") == plan.placement.group_of("tp", 5)
        assert (g.size("tp"), g.size("pp"), g.size("dp")) == (2, 2, 2)
    finally:
        dist.destroy_process_group()
    _fake_world(0, 3)
    try:
        with pytest.raises(LayoutError, match="places 8 ranks"):
            create_groups(plan)
    finally:
        dist.destroy_process_group()


def _check_membership(g, tag: str) -> None:
    """All-gather the global rank over each group: proves the group's real members and their order."""
    for kind in KINDS:
        handle = g.group(kind)
        out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(handle))]
        dist.all_gather(out, torch.tensor([g.rank]), group=handle)
        got = [int(t) for t in out]
        assert got == g.ranks(kind), (f"{tag}: {kind} group of rank {g.rank} "
                                      f"has members {got}, plan {g.ranks(kind)}")


def _check_pipeline_grid(g, tag: str) -> None:
    """DeepSpeed's own PipelineParallelGrid, fed dsforge's topology, builds the plan's groups."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    ensure_deepspeed_comm()
    grid = PipelineParallelGrid(topology=g.pipe_topology())
    assert grid.dp_group == g.ranks("dp-cp"), tag
    assert grid.pp_group == g.ranks("pp"), tag
    assert dist.get_process_group_ranks(grid.ds_model_proc_group) == g.ranks("tp-pp"), tag
    if g.size("tp") > 1:
        assert grid.slice_group == g.ranks("tp"), tag
    assert (grid.get_stage_id(), grid.get_slice_parallel_rank()) == (g.index("pp"), g.index("tp")), tag


def _check_engine_uses_plan_groups(g) -> None:
    """deepspeed.initialize(mpu=...) with ZeRO-1: DeepSpeed's DP and ZeRO groups are the plan's."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "steps_per_print": 10 ** 6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config, mpu=g.mpu())
    try:
        assert engine.dp_world_size == g.size("dp") and engine.mp_world_size == g.size("tp-pp")
        assert engine.train_batch_size() == g.size("dp")  # the batch rule counts dp, not the whole world
        assert dist.get_process_group_ranks(engine.seq_data_parallel_group) == g.ranks("dp-cp")
        assert dist.get_process_group_ranks(engine.optimizer.dp_process_group) == g.ranks("dp-cp")
        loss = engine(torch.full((1, 4), float(g.rank))).sum()
        engine.backward(loss)
        engine.step()
        mine = model.weight.detach().clone()
        peers = [torch.empty_like(mine) for _ in range(g.size("dp"))]
        dist.all_gather(peers, mine, group=g.dp)
        assert all(torch.equal(p, mine) for p in peers), "ZeRO left data-parallel replicas out of step"
    finally:
        ds_groups.mpu = None  # DeepSpeed keeps the mpu in a module global; later checks must not see it


def _four_rank_worker(rank: int, world: int) -> None:
    from tests.runtime.test_context_parallel import check_ring
    from tests.runtime.test_moe import DenseTop2MoE, check_moe_parity

    layouts = {"tp2xdp2": (2, 1, 2, 1, 1, "tp-cp-ep-dp-pp"), "tp2xpp2": (2, 2, 1, 1, 1, "tp-cp-ep-dp-pp"),
               "dp2xep2 (ep slower than dp)": (1, 1, 4, 1, 2, "tp-cp-dp-ep-pp"),
               "tp2xcp2": (2, 1, 1, 2, 1, "tp-cp-ep-dp-pp"), "cp4": (1, 1, 1, 4, 1, "tp-cp-ep-dp-pp")}
    built = {tag: create_groups(_placement(layout)) for tag, layout in layouts.items()}
    for tag, g in built.items():
        _check_membership(g, tag)
    _check_pipeline_grid(built["tp2xpp2"], "tp2xpp2")
    _check_pipeline_grid(built["tp2xdp2"], "tp2xdp2")
    # ep groups [0, 2], [1, 3]: DeepSpeed alone would pair consecutive ranks; the layer must use the plan's.
    moe_groups = built["dp2xep2 (ep slower than dp)"]
    assert moe_groups.ranks("ep") == [rank % 2, rank % 2 + 2]
    check_moe_parity(moe_groups, DenseTop2MoE(seed=3), seed=3)
    from dsforge.runtime.moe import register_expert_groups

    with pytest.raises(LayoutError, match="already holds ep groups"):
        register_expert_groups(create_groups(_placement((1, 1, 4, 1, 2, "tp-cp-ep-dp-pp"))))
    check_ring(built["cp4"].cp, causal=True, load_balanced=True, seed=5)  # 4 hops: direction matters
    check_ring(built["tp2xcp2"].cp, causal=True, load_balanced=True, seed=6)  # cp ranks [0, 2] and [1, 3]
    _check_engine_uses_plan_groups(built["tp2xdp2"])


@pytest.mark.slow
def test_groups_deepspeed_adapters_moe_and_ring_on_four_ranks() -> None:
    pytest.importorskip("deepspeed")
    run(_four_rank_worker, 4)
