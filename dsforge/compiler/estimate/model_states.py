"""Model-state bytes of one rank: weights, gradients, optimizer state and DeepSpeed's own buffers.

The split into 16-bit weights + 16-bit gradients + fp32 master weights + fp32 optimizer moments is
Rajbhandari et al. 2020 (ZeRO), sec. 3.1 (2 + 2 + 12 bytes per parameter for mixed-precision Adam),
partitioned over the data-parallel ranks by stage (sec. 3.1/5: stage 1 divides the 12 bytes, stage 2
also the gradients, stage 3 also the weights). Which buffers DeepSpeed 0.19.8 really keeps, and when,
was read from its source and measured on real engines (tests/compiler/estimate/test_memory_measured.py). Two
moments can set a rank's peak, so both are estimated:

* ``backward``: while the step's last micro-batch runs backward (activations live);
* ``update``: after autograd, while gradients are reduced and the optimizer steps (activations freed).

Per configuration (P: parameters on the rank, Pn: its ZeRO partition, b: bytes per weight, k: optimizer
bytes per parameter, B: reduce_bucket_size elements):

* no ZeRO, fp32: the torch optimizer on the model's tensors, 4P + 4P + kP; after backward the engine
  all-reduces flattened copies of the gradients (engine.py `allreduce_gradients`, up to 5e8 elements);
* no ZeRO, 16-bit: FP16_Optimizer / FP16_UnfusedOptimizer (`runtime/fp16/`) keep a full fp32 master
  copy and, in the step, fp32 gradients next to the 16-bit .grad: bP + (b+4)P + (4+k)P;
* bf16 with a pipeline and no ZeRO, or ZeRO-1 with `data_types.grad_accum_dtype: fp32`:
  BF16_Optimizer (`runtime/bf16_optimizer.py`): a full flat accumulation buffer and an fp32 master
  partition (read from the source; not measured here, it needs a PipelineModule);
* ZeRO 1 (`runtime/zero/stage_1_and_2.py`): flat weights bP, fp32 master and moments (4+k)Pn. In
  backward every .grad is full (bP) next to the reduction bucket (bB); in the boundary reduction the
  contiguous partition buffer (`grads_in_partition`, bPn) is allocated while most .grad are still
  full (bP + bPn); in the step an fp32 gradient partition (4Pn) replaces the 16-bit ones;
* ZeRO 2: in backward the partition buffer (bPn), its accumulation copy (`all_grad_tensors`, bPn, only
  when micro-batches accumulate), the bucket and the gradients waiting for their hook (at most one
  bucket): 2bPn + 2bB; the step as ZeRO 1. Two buckets more with overlap_comm (`setup_buckets`);
* ZeRO 3 (`runtime/zero/stage3.py`): weight partitions bPn plus whole tensors at or below the
  persistence threshold, a gradient partition buffer bPn and one reduce bucket bB that stay allocated,
  in forward/backward the gathered working set (largest module plus the prefetch bucket, capped by
  max_live_parameters; an upper bound), and in the step the fp32 gradient partition 4Pn.

`allgather_bucket_size` allocates nothing of its own: ZeRO 1/2 gather the updated partitions straight into
the flat weight buffer (measured: the all-gather moment adds no bytes).

CPU offload (ZeRO-Offload, Ren et al. 2021) moves the fp32 master, moments and fp32 gradients to the
host, reported under ``host`` (read from the source; DeepSpeedCPUAdam is not built or measured here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsforge.compiler.estimate.shares import RankParams
from dsforge.compiler.estimate.zero_config import ZeroSettings

FP32 = 4
ALLREDUCE_BUCKET = 5e8  # elements; deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE

States = dict[str, float]


@dataclass
class ModelStates:
    """Device bytes of one rank's model states at its two candidate peak moments, and host bytes.

    Component names are "parameters", "gradients", "optimizer" and "buffers" (communication
    buckets, gathered ZeRO-3 weights, transient copies), shared with `memory.DEVICE_COMPONENTS`.
    """

    backward: States = field(default_factory=dict)
    update: States = field(default_factory=dict)
    host: States = field(default_factory=dict)
    step: States = field(default_factory=dict)  # inside the optimizer step (part of update); default: update

    def __post_init__(self) -> None:
        if not self.step:
            self.step = dict(self.update)

    @property
    def peak(self) -> float:
        """The larger of the two moments' device totals."""
        return max(sum(self.backward.values()), sum(self.update.values()))


def _states(params: float, grads: float, optimizer: float, buffers: float = 0.0) -> States:
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "buffers": buffers}


def _larger(*moments: States) -> States:
    return max(moments, key=lambda s: sum(s.values()))


def uses_bf16_optimizer(z: ZeroSettings) -> bool:
    """True when DeepSpeed wraps the optimizer in BF16_Optimizer (engine `_do_optimizer_sanity_check`)."""
    if z.weight_bytes != 2 or z.stage > 1:
        return False
    if z.stage == 1:
        return z.fp32_grad_accum and not z.offload_optimizer
    return z.pipeline and z.precision == "bf16"


def model_states(share: RankParams, z: ZeroSettings, n_dense: int, n_expert: int,
                 micro_batches: int = 1) -> ModelStates:
    """Bytes of weights, gradients, optimizer state and ZeRO buffers one rank keeps (see module doc).

    ``n_dense`` and ``n_expert`` are the ranks ZeRO partitions dense and expert parameters over
    (dp x cp, and the expert-data-parallel degree).
    """
    p, b, k = share.total, z.weight_bytes, z.optimizer_bytes
    pn = share.dense / n_dense + share.expert / n_expert
    # With experts ZeRO keeps two param groups and steps the dense one first (see _zero12).
    first_group = share.dense / n_dense if share.expert and share.dense else None
    if uses_bf16_optimizer(z):
        accum = FP32 if z.fp32_grad_accum else b
        same = _states(b * p, accum * p, (FP32 + k) * pn)
        update = _with_allreduce_copy(same, p, accum) if z.stage == 0 else dict(same)
        return ModelStates(same, update, step=dict(same))
    if z.stage == 0:
        return _no_zero(p, b, k)
    if z.stage in (1, 2):
        return _zero12(p, pn, b, k, z, micro_batches, first_group)
    return _zero3(share, pn, b, k, z)


def _no_zero(p: float, b: int, k: int) -> ModelStates:
    """No ZeRO: fp32 trains in place; 16-bit adds a full fp32 master and, in the step, fp32 gradients."""
    if b == FP32:
        same = _states(FP32 * p, FP32 * p, k * p)
        return ModelStates(same, _with_allreduce_copy(same, p, FP32), step=dict(same))
    backward = _states(b * p, b * p, (FP32 + k) * p)
    step = _states(b * p, (b + FP32) * p, (FP32 + k) * p)
    return ModelStates(backward, _larger(step, _with_allreduce_copy(backward, p, b)), step=step)


def _with_allreduce_copy(states: States, p: float, grad_bytes: int) -> States:
    """The engine all-reduces gradients in flattened buckets of up to 5e8 elements: a transient copy."""
    return {**states, "buffers": states.get("buffers", 0.0) + min(p, ALLREDUCE_BUCKET) * grad_bytes}


def _bucket_bytes(z: ZeroSettings) -> float:
    """Reduction bucket(s) of reduce_bucket_size elements: two with overlap_comm, none without
    contiguous_gradients (`setup_buckets` in stage_1_and_2.py)."""
    if not z.contiguous_gradients:
        return 0.0
    return z.reduce_bucket * z.weight_bytes * (2 if z.overlap_comm else 1)


def _zero12(p: float, pn: float, b: int, k: int, z: ZeroSettings, m: int,
            first_group: float | None = None) -> ModelStates:
    """ZeRO 1/2 (DeepSpeedZeroOptimizer); see the module doc for each buffer.

    ``first_group`` is the partition of the group stepped first when there are several (MoE: dense,
    then expert): while it steps, the later group's reduced gradients keep the whole contiguous
    partition buffer alive, so the step holds 4 x first_group + bPn, not 4Pn (measured on tiny-moe-ep2,
    ZeRO 1 and 2, fp32 and bf16).
    """
    bucket = _bucket_bytes(z)
    if z.stage == 1:
        grads_bwd, buffers_bwd, grads_reduce = b * p, bucket, b * (p + pn)
    else:
        in_flight = z.reduce_bucket * b if z.contiguous_gradients else 0.0
        grads_bwd = b * pn * (2 if m > 1 else 1) + in_flight
        buffers_bwd, grads_reduce = bucket, grads_bwd + bucket
    optimizer = (FP32 + k) * pn
    if z.offload_optimizer:
        return _zero12_offload(p, pn, b, optimizer, z, m)
    grads_step = (
        FP32 * pn if first_group is None else FP32 * first_group + (FP32 if z.fp32_grad_accum else b) * pn
    )
    step = _states(b * p, grads_step, optimizer)
    update = _larger(_states(b * p, grads_reduce, optimizer), step)
    return ModelStates(_states(b * p, grads_bwd, optimizer, buffers_bwd), update, step=step)


def _zero12_offload(p: float, pn: float, b: int, optimizer: float, z: ZeroSettings, m: int) -> ModelStates:
    """ZeRO-Offload with ZeRO 1/2: reduced gradients go straight to the fp32 partition in pinned host
    memory (`copy_grads_in_partition`), next to the fp32 master, the moments, a 16-bit staging copy of
    the partition (`param_buffer_of_bit16_for_cpu_offload_groups`, allocated on the master's device)
    and, when micro-batches accumulate, `accumulated_grads_in_cpu`. The device keeps the 16-bit
    weights, stage 1's full .grad, stage 2's bucket and in-flight gradients. Read from the source, not
    measured (DeepSpeedCPUAdam is not built on this machine)."""
    bucket = _bucket_bytes(z)
    grads_bwd = b * p if z.stage == 1 else z.reduce_bucket * b
    grads_update = b * p if z.stage == 1 else 0.0
    host = {"optimizer": optimizer, "gradients": FP32 * pn * (2 if m > 1 else 1), "buffers": b * pn}
    return ModelStates(_states(b * p, grads_bwd, 0.0, bucket), _states(b * p, grads_update, 0.0), host)


def _zero3(share: RankParams, pn: float, b: int, k: int, z: ZeroSettings) -> ModelStates:
    """ZeRO 3 (DeepSpeedZeroOptimizer_Stage3); see the module doc for each buffer."""
    gathered = min(z.max_live_parameters, share.largest_module + z.prefetch_bucket) * b
    params = b * (pn + share.small)
    grads = b * pn + z.reduce_bucket * b
    optimizer = (FP32 + k) * pn
    host: States = {}
    if z.offload_params:
        host["parameters"] = b * pn
        params = b * share.small
    if z.offload_optimizer:
        host.update({"optimizer": optimizer, "gradients": FP32 * pn})
        return ModelStates(_states(params, grads, 0.0, gathered), _states(params, grads, 0.0), host)
    return ModelStates(_states(params, grads, optimizer, gathered),
                       _states(params, grads + FP32 * pn, optimizer), host)


def megatron_states(share: RankParams, z: ZeroSettings, n_dense: int, n_expert: int, fp32_grads: bool,
                    distributed: bool, fp8_recipe: str | None = None) -> ModelStates:
    """Model states under Megatron-Core (the `megatron-te` stack): 16-bit weights, a contiguous main-grad
    buffer (fp32 with ``fp32_grads``, megatron/core/distributed/param_and_grad_buffer.py) and fp32 master
    weights and moments, sharded over data parallelism with the distributed optimizer (zero: 1):
    docs/source/api-guide/dist_optimizer.md gives 6 + 12/d bytes per parameter for bf16 weights and fp32
    grads (18 without), which this reproduces; dense parameters shard over dp x cp, experts over expert-dp.
    zero 2/3 are Megatron-FSDP's shardings and ``fp8_recipe`` adds TE's FP8 weight caches
    (stacks/megatron_fsdp.py)."""
    from dsforge.compiler.estimate.stacks.megatron_fsdp import fp8_cache_bytes, fsdp_parts

    b, k = z.weight_bytes, z.optimizer_bytes
    p = share.dense + share.expert
    pn = share.dense / max(1, n_dense) + share.expert / max(1, n_expert)
    gb = 4 if fp32_grads or b == 4 else b
    master = 0 if b == 4 else 4
    per = master + k
    if distributed and z.stage >= 1:
        optimizer = per * pn
    else:
        optimizer = per * p
    weights, grads, gathered = fsdp_parts(z.stage if distributed else 0, b, gb, p, pn, share.largest_module)
    same = _states(weights, grads, optimizer,
                   gathered + fp8_cache_bytes(fp8_recipe, p if z.stage < 3 else pn))
    return ModelStates(same, dict(same), step=dict(same))
