"""torch.distributed process groups built exactly as the plan placed the ranks, and DeepSpeed's views of them.

Every rank creates every group of every kind in one fixed order (``new_group`` is collective over
the whole world even for groups a rank is not in), keeps the handle of the groups that contain it,
and hands them out explicitly: a ``ParallelGroups`` object is passed to layers (Megatron's
``process_groups_config.py``, nanotron's ``pg=``), never read from a module global. Two adapters
give DeepSpeed the same groups: ``DeepSpeedMPU`` (the ``mpu=`` argument of ``deepspeed.initialize``,
so ZeRO reduces over the plan's data-parallel group) and ``pipe_topology`` (the ``topology=`` of a
``PipelineModule``, whose ``PipelineParallelGrid`` then builds the plan's groups itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from dsforge.compiler.plan.placement import Placement
from dsforge.runtime.errors import RuntimeRefusal

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from dsforge.compiler.plan.plan import AnyPlan

# Creation order; identical on every rank, which is what new_group requires.
KINDS: tuple[str, ...] = ("tp", "cp", "dp", "dp-cp", "pp", "tp-pp", "ep", "edp")


class LayoutError(RuntimeRefusal, RuntimeError):
    """The launched processes or the plan's layout cannot give the groups the plan asks for."""


def degrees_of(placement: Placement) -> dict[str, int]:
    """The dense degrees (tp, cp, dp, pp) and ep read back from a placement's group sizes."""
    return {kind: len(placement.groups[kind][0]) for kind in ("tp", "cp", "dp", "pp", "ep")}


def check_world_size(placement: Placement, launched: int | None = None) -> None:
    """Raise LayoutError unless the launched world size equals the number of ranks the plan places."""
    if launched is None:
        launched = dist.get_world_size()
    if launched == placement.world_size:
        return
    d = degrees_of(placement)
    layout = " x ".join(f"{k}={d[k]}" for k in ("tp", "cp", "dp", "pp"))
    raise LayoutError(
        f"the plan places {placement.world_size} ranks ({layout}) but {launched} processes were launched; "
        f"launch exactly {placement.world_size} (e.g. torchrun --nproc_per_node {placement.gpus_per_node} "
        f"--nnodes {max(1, placement.world_size // placement.gpus_per_node)}) or change the job's degrees")


def ensure_deepspeed_comm() -> None:
    """Let deepspeed.comm wrap the already-initialised torch.distributed world (DeepSpeed's collectives need
    it)."""
    import deepspeed.comm as ds_dist

    if not ds_dist.is_initialized():
        ds_dist.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def _placement_of(plan: AnyPlan | Placement) -> Placement:
    """The plan's placement, or a LayoutError saying why it has none."""
    if isinstance(plan, Placement):
        return plan
    if plan.placement is not None:
        return plan.placement
    reason = plan.order_error() or (
        f"degrees {plan.degrees} do not fill the job's {plan.world_size} ranks" if plan.degrees
        else "some degree is still `auto`; set it to a number before launching")
    raise LayoutError(f"the plan has no rank placement: {reason}")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process group of every kind, with the plan's placement they were built from."""

    placement: Placement
    rank: int
    handles: dict[str, dist.ProcessGroup] = field(repr=False)
    members: dict[str, list[int]] = field(default_factory=dict)

    def group(self, kind: str) -> dist.ProcessGroup:
        """The process group of this kind that contains this rank."""
        return self.handles[kind]

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of this kind, in group-rank order."""
        if kind not in self.members:
            self.members[kind] = self.placement.group_of(kind, self.rank)
        return self.members[kind]

    def size(self, kind: str) -> int:
        """Number of ranks in this rank's group of this kind."""
        return len(self.ranks(kind))

    def index(self, kind: str) -> int:
        """This rank's position inside its group of this kind (tp rank, pipeline stage, ...)."""
        return self.ranks(kind).index(self.rank)

    @property
    def tp(self) -> dist.ProcessGroup:
        """Tensor-parallel group."""
        return self.handles["tp"]

    @property
    def cp(self) -> dist.ProcessGroup:
        """Context-parallel group (ring or Ulysses)."""
        return self.handles["cp"]

    @property
    def dp(self) -> dist.ProcessGroup:
        """Data-parallel group (replicas of the dense weights at one cp position)."""
        return self.handles["dp"]

    @property
    def dp_cp(self) -> dist.ProcessGroup:
        """Data x context group: dense gradients are reduced over it."""
        return self.handles["dp-cp"]

    @property
    def pp(self) -> dist.ProcessGroup:
        """Pipeline group (one rank per stage)."""
        return self.handles["pp"]

    @property
    def tp_pp(self) -> dist.ProcessGroup:
        """Model-parallel group in Megatron's sense: tensor x pipeline."""
        return self.handles["tp-pp"]

    @property
    def ep(self) -> dist.ProcessGroup:
        """Expert-parallel group (all-to-all of tokens between expert shards)."""
        return self.handles["ep"]

    @property
    def edp(self) -> dist.ProcessGroup:
        """Expert-data-parallel group: expert gradients are reduced over it."""
        return self.handles["edp"]

    def mpu(self) -> DeepSpeedMPU:
        """The adapter to pass as ``deepspeed.initialize(mpu=...)``."""
        return DeepSpeedMPU(self)

    def pipe_topology(self) -> ProcessTopology:
        """The topology to pass as ``PipelineModule(topology=...)``."""
        return pipe_topology(self.placement)


def create_groups(plan: AnyPlan | Placement) -> ParallelGroups:
    """Create every group of the plan on every rank (collective) and return this rank's handles.

    Rank sets shared by two kinds (dp and dp-cp when cp = 1, say) get one process group, so the
    number of communicators stays the number of distinct rank sets.
    """
    if not dist.is_initialized():
        raise LayoutError("torch.distributed is not initialised; call torch.distributed.init_process_group "
                          "(or deepspeed.init_distributed) before create_groups")
    placement = _placement_of(plan)
    check_world_size(placement)
    rank = dist.get_rank()
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    handles: dict[str, dist.ProcessGroup] = {}
    members: dict[str, list[int]] = {}
    for kind in KINDS:
        for ranks in placement.groups[kind]:
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(list(ranks))
            if rank in ranks:
                handles[kind], members[kind] = made[key], list(ranks)
    return ParallelGroups(placement, rank, handles, members)


class DeepSpeedMPU:
    """The "model parallel unit" DeepSpeed queries (deepspeed/utils/groups.py, utils/bwc.py,
    runtime/engine.py).

    Data parallel = the plan's dp group (DeepSpeed's batch rule counts it); sequence parallel = cp
    and sequence-data parallel = dp x cp, over which DeepSpeed and ZeRO reduce and partition
    (they divide by the dp size only, DeepSpeed's Ulysses convention: each cp rank's loss must be
    its share of the whole sequence's loss). Model parallel = tensor x pipeline, as in Megatron;
    DeepSpeed sums grad norms over it. It deliberately has no ``initialize_sequence_parallel``:
    DeepSpeed reads that attribute as "ignore this mpu's data-parallel group".
    """

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups

    def _rank(self, kind: str) -> int:
        return self.groups.index(kind)

    def _size(self, kind: str) -> int:
        return self.groups.size(kind)

    def get_model_parallel_rank(self) -> int:
        """Rank inside tensor x pipeline."""
        return self._rank("tp-pp")

    def get_model_parallel_world_size(self) -> int:
        """Size of tensor x pipeline."""
        return self._size("tp-pp")

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """Tensor x pipeline group."""
        return self.groups.tp_pp

    def get_tensor_model_parallel_rank(self) -> int:
        """Rank inside the TP group."""
        return self._rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        """TP degree."""
        return self._size("tp")

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        """TP group."""
        return self.groups.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (broadcast source)."""
        return self.groups.ranks("tp")[0]

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self._rank("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self._size("pp")

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        """Pipeline group."""
        return self.groups.pp

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        """Rank inside the data-parallel group."""
        return self._rank("dp")

    def get_data_parallel_world_size(self) -> int:
        """DP degree (what DeepSpeed's batch rule multiplies by)."""
        return self._size("dp")

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        """Data-parallel group."""
        return self.groups.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of the data-parallel group."""
        return self.groups.ranks("dp")

    def get_sequence_parallel_rank(self) -> int:
        """Rank inside the context-parallel group."""
        return self._rank("cp")

    def get_sequence_parallel_world_size(self) -> int:
        """CP degree."""
        return self._size("cp")

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        """Context-parallel group."""
        return self.groups.cp

    def get_sequence_data_parallel_rank(self) -> int:
        """Rank inside data x context."""
        return self._rank("dp-cp")

    def get_sequence_data_parallel_world_size(self) -> int:
        """Size of data x context."""
        return self._size("dp-cp")

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        """Data x context group (ZeRO's partition and reduction group)."""
        return self.groups.dp_cp


# DeepSpeed's pipeline grid knows three axes; cp folds into "data" (see pipe_topology).
_DS_AXIS = {"pp": "pipe", "dp": "data", "cp": "data", "tp": "model"}


def pipe_axes(placement: Placement) -> tuple[list[str], list[int]]:
    """DeepSpeed topology axes (slowest first, DeepSpeed's row-major convention) and their sizes.

    The plan's order lists axes fastest first, so it is reversed. DeepSpeed's PipelineEngine
    reduces gradients over its "data" axis only, so with cp > 1 the cp axis is merged into "data"
    (the grid's data groups are then the plan's dp x cp groups); that needs cp and dp adjacent
    among the axes of size > 1, else no DeepSpeed topology can express the plan.
    """
    d = degrees_of(placement)
    dense = [a for a in reversed(placement.order) if a in _DS_AXIS and d[a] > 1]
    merged: list[str] = []
    for axis in dense:
        name = _DS_AXIS[axis]
        if merged and merged[-1] == name:
            continue
        if name in merged:
            between = (
                dense[dense.index("cp") + 1 : dense.index("dp")]
                or dense[dense.index("dp") + 1 : dense.index("cp")]
            )
            raise LayoutError(
                f"order {'-'.join(placement.order)!r} puts {'-'.join(between)} between cp and dp; "
                f"DeepSpeed's PipelineEngine reduces gradients over one 'data' axis, so cp must sit next to "
                f"dp (e.g. order tp-cp-ep-dp-pp)")
        merged.append(name)
    for name in ("pipe", "data", "model"):  # DeepSpeed's grid reads all three; size-1 axes go anywhere
        if name not in merged:
            merged.append(name)
    sizes = {"pipe": d["pp"], "data": d["dp"] * d["cp"], "model": d["tp"]}
    return merged, [sizes[a] for a in merged]


def pipe_topology(placement: Placement) -> ProcessTopology:
    """A DeepSpeed ProcessTopology whose pipe/data/model groups are the plan's pp/(dp x cp)/tp groups.

    Raises LayoutError if the order cannot be expressed, or if DeepSpeed's groups differ from the
    plan's for any rank (checked group by group, so a mismatch never reaches a training run).
    """
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

    axes, dims = pipe_axes(placement)
    topo: ProcessTopology
    if axes == ["pipe", "data", "model"]:
        topo = PipeModelDataParallelTopology(num_pp=dims[0], num_mp=dims[2], num_dp=dims[1])
    else:
        topo = ProcessTopology(axes=axes, dims=dims)
    expected = {"pipe": "pp", "data": "dp-cp", "model": "tp"}
    for axis, kind in expected.items():
        got = sorted(topo.get_axis_comm_lists(axis))
        if got != placement.groups[kind]:
            raise LayoutError(f"DeepSpeed topology axis {axis!r} gives groups {got[:4]}..., "
                              f"the plan's {kind} groups are {placement.groups[kind][:4]}...")
    # The grid's "model parallel" group (for overflow checks and grad norms) fixes the data coordinate.
    model = sorted(sorted(topo.get_axis_list("data", i)) for i in range(topo.get_dim("data")))
    if model != placement.groups["tp-pp"]:
        raise LayoutError(f"DeepSpeed's model-parallel groups {model[:4]}... differ from the plan's "
                          f"tensor x pipeline groups {placement.groups['tp-pp'][:4]}...")
    return topo
