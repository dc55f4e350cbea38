"""Communication: alpha-beta costs, the link each group crosses, and what TP, CP, EP, PP and ZeRO send."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsforge.compiler.estimate import comm
from dsforge.compiler.estimate.shares import stage_share
from dsforge.compiler.estimate.summary import communication_rows
from tests.test_explain_helpers import SMALL, make_plan, with_changes

NVLINK = comm.Link("intra_node", 100e9, 2e-6)


def test_ring_all_reduce_cost_is_2_n_minus_1_over_n() -> None:
    n, size = 8, 1e9
    expected = 2 * (n - 1) / n * size / 100e9 + 2 * (n - 1) * 2e-6
    assert comm.collective_seconds("all-reduce", size, n, NVLINK) == pytest.approx(expected)
    ag = comm.collective_seconds("all-gather", size, n, NVLINK)
    rs = comm.collective_seconds("reduce-scatter", size, n, NVLINK)
    assert ag + rs == pytest.approx(expected)  # SP's AG + RS moves what one all-reduce moves
    assert comm.collective_seconds("all-to-all", size, n, NVLINK) == pytest.approx(ag)
    assert comm.collective_seconds("p2p", size, 2, NVLINK) == pytest.approx(size / 100e9 + 2e-6)
    assert comm.collective_seconds("all-reduce", size, 1, NVLINK) == 0.0
    assert comm.wire_bytes("all-reduce", size, n) == pytest.approx(2 * 7 / 8 * size)


def test_a_ring_across_nodes_pays_the_network_latency_on_its_crossing_steps_only(tmp_path: Path) -> None:
    # NCCL's ring model (src/graph/tuning.cc): nodes-1 inter-node steps of an all-gather or reduce-scatter,
    # 2(nodes-1) of an all-reduce; the other steps at the node's link latency
    net = comm.Link("inter_node", 25e9, 10e-6, nodes=4, intra_latency_s=3e-6)
    n, size = 32, 1e6
    band = comm.wire_bytes("all-gather", size, n) / 25e9
    assert comm.collective_seconds("all-gather", size, n, net) == pytest.approx(band + 3 * 10e-6 + 28 * 3e-6)
    assert comm.collective_seconds("all-reduce", size, n, net) == pytest.approx(
        2 * band + 6 * 10e-6 + 56 * 3e-6)
    flat = comm.Link("inter_node", 25e9, 10e-6)
    a2a = comm.collective_seconds("all-to-all", size, n, net)
    assert a2a == comm.collective_seconds("all-to-all", size, n, flat)
    # a data-parallel group of 32 over 4 DGX nodes (tp 1) spans 4 of them
    plan = make_plan(with_changes(SMALL, hardware={"nodes": 4}, launch={"launcher": "slurm"},
                                  parallel={"tp": 1, "pp": 1}), tmp_path)
    link = comm.link_of(plan, "dp-cp")
    assert (link.name, link.nodes, link.intra_latency_s) == ("inter_node", 4, 3e-6)


def test_groups_inside_a_node_use_nvlink_and_groups_across_nodes_the_network(tmp_path: Path) -> None:
    job = with_changes(SMALL, hardware={"nodes": 2}, parallel={"tp": 8, "pp": 2},
                       launch={"launcher": "slurm"})
    plan = make_plan(job, tmp_path)
    assert comm.link_of(plan, "tp").name == "intra_node"
    assert comm.link_of(plan, "pp").name == "inter_node"
    # line rate x NCCL bus efficiency
    assert comm.link_of(plan, "tp").bandwidth_Bps == pytest.approx(450e9 * 0.82)
    assert comm.link_of(plan, "pp").bandwidth_Bps == pytest.approx(50e9 * 0.9)
    # the same degrees with pipeline stages inside a node and tp spread over both nodes
    spread = make_plan(with_changes(job, parallel={"order": "pp-tp-cp-ep-dp"}), tmp_path)
    assert comm.link_of(spread, "tp").name == "inter_node"
    assert comm.link_of(spread, "pp").name == "intra_node"


def test_tensor_parallel_volume_is_the_same_with_sequence_parallelism(tmp_path: Path) -> None:
    plain = make_plan(SMALL, tmp_path)
    sp = make_plan(with_changes(SMALL, parallel={"sequence_parallel": True}), tmp_path)

    def per_layer(plan: object) -> float:
        return sum(o.sent_bytes for o in comm.tensor_parallel(plan) if o.scope == "layer")  # type: ignore[arg-type]

    act = 4096 * 4096 * 2  # b x s x h x bf16 of llama2-7b
    assert per_layer(plain) == pytest.approx(4 * 2 * (2 - 1) / 2 * act)  # 4 all-reduces per layer
    assert per_layer(sp) == pytest.approx(per_layer(plain))
    # with SP the pipeline sends only this rank's 1/tp of the sequence
    pp_plain = next(o for o in comm.pipeline_parallel(plain) if o.op == "p2p")
    pp_sp = next(o for o in comm.pipeline_parallel(sp) if o.op == "p2p")
    assert pp_sp.payload_bytes == pytest.approx(pp_plain.payload_bytes / 2)


@pytest.mark.parametrize("zero,per_step_factor", [(0, 2.0), (1, 2.0), (2, 2.0), (3, 3.0)])
def test_zero_stages_move_2_or_3_psi(tmp_path: Path, zero: int, per_step_factor: float) -> None:
    # Rajbhandari et al. 2020 sec. 7: ZeRO-0/1/2 move 2 Psi per step, ZeRO-3 3 Psi (for one micro-batch);
    # a 1.5B model, because a 7B one needs ~140 GB per GPU without ZeRO and fails the memory rule (DSF301)
    job = with_changes(SMALL, model={"preset": "gpt2-xl"}, parallel={"tp": 1, "pp": 1, "zero": zero},
                       training={"global_batch": 8, "micro_batch": 1})
    plan = make_plan(job, tmp_path)
    assert plan.grad_accum == 1
    rows = [r for r in communication_rows(plan, 0, 1) if r["group"] == "dp-cp"]
    psi = sum(r["sent_bytes_per_step"] for r in rows)
    params_bytes = stage_share(plan, 0, 0.0).dense * 2
    n = 8
    # ZeRO-3 keeps the tensors under the persistence threshold (norms, biases: 0.1 % of GPT-2 XL) whole
    assert psi == pytest.approx(per_step_factor * (n - 1) / n * params_bytes, rel=2e-3 if zero == 3 else 1e-9)
    # every bucket or module is its own call (each pays the ring latency); the sizes add up to the whole
    for r in rows:
        assert r["payload_bytes"] * r["calls_per_step"] <= params_bytes * (1 + 1e-9)
    if zero == 3:
        assert min(r["calls_per_step"] for r in rows if r["collective"] == "all-gather") == 4 * 48 + 2


def test_zero2_and_zero3_communicate_every_micro_batch(tmp_path: Path) -> None:
    job = with_changes(SMALL, parallel={"tp": 1, "pp": 1}, training={"global_batch": 32})

    def sent(zero: int) -> float:
        plan = make_plan(with_changes(job, parallel={"zero": zero}), tmp_path)
        assert plan.grad_accum == 4
        return sum(r["sent_bytes_per_step"] for r in communication_rows(plan, 0, 4) if r["group"] == "dp-cp")

    one, two, three = sent(1), sent(2), sent(3)
    assert two == pytest.approx(one / 2 * (4 + 1))  # 4 reduce-scatters + 1 parameter all-gather
    # 2 gathers and a reduce-scatter per micro-batch; the norms stay whole under ZeRO-3 (persistence)
    assert three == pytest.approx(one / 2 * 3 * 4, rel=1e-3)


def test_context_parallel_ring_and_ulysses(tmp_path: Path) -> None:
    job = with_changes(SMALL, parallel={"tp": 1, "pp": 1, "cp": 4}, training={"global_batch": 2})
    ring = comm.context_parallel(make_plan(job, tmp_path))
    assert {o.op for o in ring} == {"p2p"} and all(o.repeat == 3 for o in ring)
    kv_chunk = 1024 * 4096 * 2  # s/cp tokens x kv_dim (llama2-7b has no GQA) x bf16
    assert ring[0].payload_bytes == pytest.approx(2 * kv_chunk)  # K and V
    assert ring[1].payload_bytes == pytest.approx(4 * kv_chunk)  # K, V, dK, dV
    assert all(o.overlap == "attention" for o in ring)
    uly = comm.context_parallel(make_plan(with_changes(job,
                                                       parallel={"context_parallel": {"kind": "ulysses"}}),
                                          tmp_path))
    assert {o.op for o in uly} == {"all-to-all"} and all(o.overlap == "none" for o in uly)


def test_expert_parallel_all_to_all_carries_top_k_copies_padded_to_capacity(tmp_path: Path) -> None:
    job = {"version": 1, "model": {"preset": "tiny-mixtral"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2},
           "parallel": {"dp": "auto", "ep": 2, "zero": 1}, "training": {"global_batch": 4, "micro_batch": 2,
                                                                        "precision": "fp32"}}
    ops = comm.expert_parallel(make_plan(job, tmp_path))
    tokens_bytes = 2 * 64 * 64 * 4  # micro_batch x seq x hidden x fp32
    assert [o.phase for o in ops] == ["forward", "backward"]
    # top_k 2, dispatch+combine
    assert all(o.payload_bytes == tokens_bytes * 2 * 1.0 and o.repeat == 2 for o in ops)
    rows = communication_rows(make_plan(job, tmp_path), 0, 1)
    assert {r["group"] for r in rows} == {"ep", "dp-cp"}  # expert dp = dp x cp / ep = 1: no expert reduction


def test_tied_embeddings_are_all_reduced_between_first_and_last_stage(tmp_path: Path) -> None:
    job = {"version": 1, "model": {"preset": "tiny-gpt2"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"pp": 2, "dp": 1},
           "training": {"global_batch": 4, "precision": "fp32"}}
    plan = make_plan(job, tmp_path)
    tied = [o for o in comm.pipeline_parallel(plan) if o.scope == "step"]
    assert len(tied) == 1 and tied[0].op == "all-reduce"
    assert tied[0].payload_bytes == pytest.approx(256 * 64 * 4)  # the word embedding only, fp32
