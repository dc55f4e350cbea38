"""Communication of a training step: which collectives each group runs, their bytes, and their time.

Every collective is timed with the alpha-beta model over the one link its group actually crosses:
NVLink (``hardware.intra_node``) when every group of that kind sits inside one node, the network
(``hardware.inter_node``, bandwidth per GPU) as soon as one group spans two nodes, as read from the
rank placement. A ring algorithm over n ranks moves (n-1)/n of the payload per step of an
all-gather or reduce-scatter and 2(n-1)/n per all-reduce (Patarasuk and Yuan 2009; Thakur et al.
2005, "Optimization of Collective Communication Operations in MPICH", sec. 4), with one link
latency per ring step. A link's usable rate is its data-sheet bandwidth times its bus efficiency
(``bus_efficiency``: the bus bandwidth nccl-tests reports over the line rate; ~0.8 on NVLink for NCCL's
protocol overhead, NVIDIA/nccl-tests#212), and every call pays its ring latency, so a collective split
into many calls (ZeRO-3's per-module gathers, bucketed reductions) costs (n-1)·alpha per call.

What each parallelism sends follows its paper; `collectives` documents every entry. Whether a
collective's time is hidden behind compute is decided in `steptime`, from the ``overlap`` tag set here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.memo import plan_memo
from dsforge.compiler.estimate.shares import (
    embedding_share,
    gathered_tensors,
    head_share,
    layer_kinds,
    stage_share,
)
from dsforge.compiler.estimate.stacks.grad_dtype import fp32_main_grads
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.plan.plan import Priced

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # fp8: TE keeps activations between GEMMs in bf16


@dataclass(frozen=True)
class Link:
    """One link class: bytes per second per GPU and the latency of one message."""

    name: str  # "intra_node" | "inter_node"
    bandwidth_Bps: float  # achieved bus bandwidth: line rate x bus efficiency
    latency_s: float
    #: nodes one group of the link spans, and the latency of a ring step between two ranks of one node: a ring
    #: over ``nodes`` nodes crosses the network on nodes - 1 of its steps only
    nodes: int = 1
    intra_latency_s: float | None = None


def link_of(plan: Priced, kind: str) -> Link:
    """The link a group kind crosses: the network if any group of that kind spans nodes, else NVLink."""
    hw = plan.spec.hardware
    crosses = plan.placement is not None and plan.placement.crosses_nodes(kind)
    spec, name = (hw.inter_node, "inter_node") if crosses else (hw.intra_node, "intra_node")
    bandwidth = spec.bandwidth_gbs * 1e9 * bus_efficiency(spec.bus_efficiency)
    latency = spec.latency_us * 1e-6
    if not crosses or plan.placement is None:
        return Link(name, bandwidth, latency)
    memo = plan_memo(plan)
    nodes = memo.get(("nodes_spanned", kind))
    if nodes is None:
        nodes = memo[("nodes_spanned", kind)] = plan.placement.nodes_spanned(kind)
    return Link(name, bandwidth, latency, nodes, hw.intra_node.latency_us * 1e-6)


def bus_efficiency(value: float | None) -> float:
    """A link's bus efficiency: the job's or preset's figure, else 1 (the data sheet's rate, optimistic)."""
    return 1.0 if value is None else value


def collective_seconds(op: str, payload: float, n: int, link: Link) -> float:
    """Alpha-beta time of one collective of ``payload`` bytes (per rank) over ``n`` ranks.

    Ring all-reduce: 2(n-1) steps moving 2(n-1)/n·bytes; all-gather, reduce-scatter and pairwise
    all-to-all: n-1 steps moving (n-1)/n·bytes; point-to-point: one step of the full payload. A ring over
    several nodes pays the network's latency on the steps that cross nodes only, 2(nodes-1) of an
    all-reduce's and nodes-1 of an all-gather's or reduce-scatter's, and the node's link latency on the
    others (NCCL's ring model, NVIDIA/nccl src/graph/tuning.cc ncclTopoTuneModel: nInterSteps).
    """
    if op == "p2p":
        return link.latency_s + payload / link.bandwidth_Bps
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all-reduce" else n - 1
    latency = steps * link.latency_s
    if link.nodes > 1 and link.intra_latency_s is not None and op in ("all-reduce", "all-gather",
                                                                          "reduce-scatter"):
        inter = min(steps, (2 if op == "all-reduce" else 1) * (link.nodes - 1))
        latency = inter * link.latency_s + (steps - inter) * link.intra_latency_s
    return latency + wire_bytes(op, payload, n) / link.bandwidth_Bps


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends for one collective: 2(n-1)/n (all-reduce), (n-1)/n (AG, RS, A2A), all (p2p)."""
    if op == "p2p":
        return payload
    if n <= 1:
        return 0.0
    return payload * (2 if op == "all-reduce" else 1) * (n - 1) / n


@dataclass(frozen=True)
class Collective:
    """One recurring collective: who runs it, how big, how often per step, and how long each call takes.

    ``scope`` says what ``calls`` counts over: "layer"/"moe-layer" (per layer of that kind per
    micro-batch), "first"/"last" (per micro-batch on the first/last chunk), "boundary" (per chunk
    boundary per micro-batch), "micro-batch" (per micro-batch), "step" (once per step).
    """

    group: str
    op: str
    purpose: str
    phase: str  # "forward" | "backward" | "step"
    scope: str
    payload_bytes: float
    group_size: int
    link: Link
    overlap: str  # "none" | "attention" | "backward" | "compute" | "dependency"
    repeat: int = 1  # calls per scope unit (ring CP: cp-1 exchanges)

    @property
    def seconds(self) -> float:
        """Time of one scope unit (``repeat`` calls)."""
        return self.repeat * collective_seconds(self.op, self.payload_bytes, self.group_size, self.link)

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends per scope unit."""
        return self.repeat * wire_bytes(self.op, self.payload_bytes, self.group_size)


def _activation_bytes(plan: Priced) -> float:
    """One layer-boundary activation of a micro-batch on one cp rank: b·(s/cp)·h elements."""
    m, t = plan.model, plan.spec.training
    return t.micro_batch * m.seq_len / plan.degrees.cp * m.hidden * DTYPE_BYTES[t.precision]


def tensor_parallel(plan: Priced) -> list[Collective]:
    """Megatron TP (Shoeybi et al. 2019, sec. 3): per layer 2 all-reduces forward, 2 backward.

    With sequence parallelism each becomes an all-gather plus a reduce-scatter of the same tensor
    (Korthikanti et al. 2022, sec. 4.2.2). The vocabulary-parallel embedding all-reduces (reduce-
    scatters with SP) its output; the LM head's input is all-gathered (SP) or its gradient all-reduced.
    Full recompute repeats the forward collectives during backward (counted in `steptime`).
    """
    tp = plan.degrees.tp
    if tp <= 1:
        return []
    act, link, sp = _activation_bytes(plan), link_of(plan, "tp"), plan.spec.parallel.sequence_parallel

    def c(op: str, purpose: str, phase: str, scope: str, calls: int = 1) -> Collective:
        return Collective("tp", op, purpose, phase, scope, act, tp, link, "none", calls)

    if sp:
        ops = [c("all-gather", "sequence-parallel inputs of attention and MLP", "forward", "layer", 2),
               c("reduce-scatter", "attention and MLP outputs", "forward", "layer", 2),
               c("all-gather", "gradients of attention and MLP outputs", "backward", "layer", 2),
               c("reduce-scatter", "gradients of attention and MLP inputs", "backward", "layer", 2),
               c("reduce-scatter", "embedding output", "forward", "first"),
               c("all-gather", "LM-head input", "forward", "last"),
               c("reduce-scatter", "LM-head input gradient", "backward", "last")]
    else:
        ops = [c("all-reduce", "attention and MLP outputs", "forward", "layer", 2),
               c("all-reduce", "attention and MLP input gradients", "backward", "layer", 2),
               c("all-reduce", "embedding output", "forward", "first"),
               c("all-reduce", "LM-head input gradient", "backward", "last")]
    return ops


def context_parallel(plan: Priced) -> list[Collective]:
    """CP per layer: ring exchange of K/V chunks, or Ulysses all-to-alls.

    Ring (Liu et al. 2023, Ring Attention; Megatron-Core context parallelism): cp-1 exchanges of this
    rank's K and V chunk forward, of K, V, dK and dV backward, overlapped with blockwise attention.
    Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses sec. 3): all-to-all of Q, K, V before attention and
    of the output after it, the same four again backward, on the critical path.
    """
    d, m = plan.degrees, plan.model
    if d.cp <= 1:
        return []
    link = link_of(plan, "cp")
    hid = _activation_bytes(plan) / d.tp  # the heads this tp rank owns
    act = hid * (m.heads * m.head_dim / m.hidden)  # Q (and the output): heads x head_dim, not always hidden
    kv = act * m.kv_heads / m.heads
    if plan.spec.parallel.context_parallel.kind == "ring":
        return [Collective("cp", "p2p", "K/V chunk around the ring", "forward", "layer", 2 * kv, d.cp, link,
                           "attention", d.cp - 1),
                Collective("cp", "p2p", "K/V and dK/dV chunks around the ring", "backward", "layer", 4 * kv,
                           d.cp, link, "attention", d.cp - 1)]
    qkv = act + 2 * kv
    return [Collective("cp", "all-to-all", "Q/K/V sequence-to-head", "forward", "layer", qkv, d.cp, link,
                       "none"),
            Collective("cp", "all-to-all", "attention output head-to-sequence", "forward", "layer", act, d.cp,
                       link, "none"),
            Collective("cp", "all-to-all", "gradients of output and Q/K/V", "backward", "layer", act + qkv,
                       d.cp, link, "none")]


def expert_parallel(plan: Priced) -> list[Collective]:
    """EP per MoE layer: dispatch and combine all-to-alls forward, both again backward.

    DeepSpeed-MoE (Rajbhandari et al. 2022, sec. 5; deepspeed/moe/sharded_moe.py) sends every
    token's top_k copies, padded to capacity_factor, to the ranks owning their experts and back.
    """
    d, m = plan.degrees, plan.model
    if d.ep <= 1 or m.moe is None:
        return []
    tokens = _activation_bytes(plan) / (d.tp if plan.spec.parallel.sequence_parallel else 1)
    payload = tokens * m.moe.top_k * m.moe.capacity_factor
    link = link_of(plan, "ep")
    return [Collective("ep", "all-to-all", "token dispatch and combine", "forward", "moe-layer", payload,
                       d.ep, link, "none", 2),
            Collective("ep", "all-to-all", "gradient dispatch and combine", "backward", "moe-layer", payload,
                       d.ep, link, "none", 2)]


def pipeline_parallel(plan: Priced) -> list[Collective]:
    """PP: one activation send forward and one gradient send backward per micro-batch and chunk boundary.

    Narayanan et al. 2021 sec. 2.2; each tp rank sends its 1/tp slice when activations are
    sequence-parallel (their scatter/gather optimisation, sec. 4.1), the whole tensor otherwise. A
    tied embedding's gradient is all-reduced between the first and last stage once per step.
    """
    d, m = plan.degrees, plan.model
    if d.pp <= 1:
        return []
    link = link_of(plan, "pp")
    act = _activation_bytes(plan) / (d.tp if plan.spec.parallel.sequence_parallel else 1)
    ops = [Collective("pp", "p2p", "activations to the next stage", "forward", "boundary", act, 2, link,
                      "dependency"),
           Collective("pp", "p2p", "activation gradients to the previous stage", "backward", "boundary", act,
                      2, link, "dependency")]
    if m.tied_embeddings:
        emb = padded_vocab(m, d.tp) * m.hidden / d.tp * DTYPE_BYTES[plan.spec.training.precision]
        ops.append(Collective("pp", "all-reduce", "tied embedding gradient (first and last stage)", "step",
                              "step", emb, 2, link, "none"))
    return ops


def _calls(elements: float, bucket: float) -> int:
    """Calls a bucketed reduction or gather of ``elements`` makes: one per full bucket (DeepSpeed's
    reduce_bucket_size / allgather_bucket_size, in elements), at least one."""
    return max(1, -int(-elements // bucket)) if bucket > 0 else 1


def _op(group: str, op: str, purpose: str, phase: str, scope: str, payload: float, n: int, link: Link,
        overlap: str, calls: int) -> Collective:
    """One collective split into ``calls`` equal calls, each paying its ring latency."""
    return Collective(group, op, purpose, phase, scope, payload / calls, n, link, overlap, calls)


def _dp_ops(group: str, n: int, params: float, plan: Priced,
            gathered: tuple[float, int] = (0.0, 0)) -> list[Collective]:
    """The ZeRO collectives over one data-parallel group for ``params`` rank-local parameters.

    ``gathered`` is ZeRO-3's (parameters fetched each pass, tensors fetched): the tensors at or below the
    persistence threshold stay whole and are not gathered, every other tensor is one all-gather call.
    Reductions run in reduce_bucket_size buckets, ZeRO-1/2's parameter gathers in allgather_bucket_size
    buckets, ZeRO-0's all-reduce in the engine's 5e8-element buckets (engine.py allreduce_gradients).
    Gradients travel in the stack's gradient dtype (`grad_bytes`), parameters in the weights' dtype.
    """
    if n <= 1 or params <= 0:
        return []
    z = zero_settings(plan)
    payload, link = params * z.weight_bytes, link_of(plan, group)
    grads = params * grad_bytes(plan)
    what = "expert " if group == "edp" else ""
    reduce_calls = _calls(params, z.reduce_bucket)
    if z.stage == 0:
        return [_op(group, "all-reduce", f"{what}gradients", "step", "step", grads, n, link, "none",
                    _calls(params, 5e8))]
    gather = _op(group, "all-gather", f"updated {what}parameters", "step", "step", payload, n, link, "none",
                 _calls(params, z.allgather_bucket))
    hide = "backward" if z.overlap_comm and not z.pipeline else "none"
    if z.stage == 1:
        return [_op(group, "reduce-scatter", f"{what}gradients", "step", "step", grads, n, link, hide,
                    reduce_calls), gather]
    if z.stage == 2:
        return [_op(group, "reduce-scatter", f"{what}gradients, every micro-batch", "backward", "micro-batch",
                     grads, n, link, hide, reduce_calls), gather]
    hide = "compute" if z.overlap_comm else "none"
    fetched, tensors = gathered
    ops = [_op(group, "reduce-scatter", f"{what}gradients", "backward", "micro-batch", grads, n, link, hide,
               reduce_calls)]
    if fetched > 0 and tensors > 0:
        ops = [_op(group, "all-gather", f"{what}parameters for forward, per module", "forward", "micro-batch",
                   fetched * z.weight_bytes, n, link, hide, tensors),
               _op(group, "all-gather", f"{what}parameters for backward, per module", "backward",
                   "micro-batch", fetched * z.weight_bytes, n, link, hide, tensors), *ops]
    return ops


def grad_bytes(plan: Priced) -> int:
    """Bytes per gradient element on the wire: the 16-bit compute dtype under DeepSpeed (its default
    communication_data_type), 4 where the stack reduces an fp32 main-grad buffer (Megatron-Core with bf16, not
    fp16: megatron/training/arguments.py turns accumulate_allreduce_grads_in_fp32 on unless
    --grad-reduce-in-bf16; param_and_grad_buffer.py reduces the buffer in its grad_dtype)."""
    weight = zero_settings(plan).weight_bytes
    t = plan.spec.training
    return 4 if fp32_main_grads(plan.spec.stack, t.grad_reduce, weight, t.precision) else weight


def data_parallel(plan: Priced, stage: int) -> list[Collective]:
    """DP collectives of one pipeline stage's ranks, by ZeRO stage (Rajbhandari et al. 2020, sec. 7).

    ZeRO-0 all-reduces gradients once per step (2Ψ). ZeRO-1 reduce-scatters them at the step and
    all-gathers the updated parameters (2Ψ); ZeRO-2 does the same but reduce-scatters after every
    micro-batch's backward (DeepSpeed stage_1_and_2.py partitions gradients as they are produced);
    ZeRO-3 all-gathers parameters before each forward and backward and reduce-scatters gradients, per
    micro-batch (3Ψ each). Dense parameters reduce over dp x cp, expert parameters over the expert-
    data-parallel group. Bytes are in the 16-bit compute dtype, DeepSpeed's default
    communication_data_type (deepspeed/runtime/engine.py); gradients in `grad_bytes`.
    """
    d = plan.degrees
    # a stage's collectives follow from its parameters: whether it is first or last and its layers by kind
    kinds = layer_kinds(plan, stage)
    key = ("data_parallel", stage == 0, stage == d.pp - 1, kinds[False], kinds[True])
    memo = plan_memo(plan)
    ops = memo.get(key)
    if ops is None:
        share = stage_share(plan, stage, 0.0)
        dense_g, expert_g = _zero3_gathers(plan, stage) if plan.zero == 3 else ((0.0, 0), (0.0, 0))
        ops = memo[key] = tuple(_dp_ops("dp-cp", d.dp * d.cp, share.dense, plan, dense_g)
                                + _dp_ops("edp", d.expert_dp, share.expert, plan, expert_g))
    return list(ops)


def _zero3_gathers(plan: Priced, stage: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """ZeRO-3's per-pass fetches on one rank of ``stage``, (parameters, tensors) for dense and for expert
    weights: every tensor above stage3_param_persistence_threshold, one all-gather call each."""
    d, model = plan.degrees, plan.model
    threshold = zero_settings(plan).persistence_threshold
    share = stage_share(plan, stage, threshold)
    dense_tensors = expert_tensors = 0
    for moe, count in layer_kinds(plan, stage).items():
        dense_n, expert_n = gathered_tensors(model, moe, d.tp, d.ep, threshold)
        dense_tensors, expert_tensors = dense_tensors + count * dense_n, expert_tensors + count * expert_n
    if stage == 0:  # the word table, and a learned position table (seq_len x hidden)
        position = embedding_share(model, d.tp) - padded_vocab(model, d.tp) * model.hidden / d.tp
        dense_tensors += (embedding_share(model, d.tp) - position > threshold) + (position > threshold)
    if stage == d.pp - 1 and head_share(model, d.tp, d.pp) - model.hidden > threshold:
        dense_tensors += 1
    # share.small counts persistent expert tensors too; tiny experts are rare, so they are taken as dense
    return (max(0.0, share.dense - share.small), dense_tensors), (share.expert, expert_tensors)


def model_parallel(plan: Priced) -> list[Collective]:
    """The collectives every stage runs alike: TP, CP, EP and PP (DP differs by stage: `data_parallel`); built
    once per plan, since every stage's passes ask."""
    memo = plan_memo(plan)
    ops = memo.get("model_parallel")
    if ops is None:
        ops = memo["model_parallel"] = tuple(
            tensor_parallel(plan) + context_parallel(plan) + expert_parallel(plan) + pipeline_parallel(plan)
        )
    return list(ops)
