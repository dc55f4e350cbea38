"""The typed job spec (format version 1): every key of a job file, its type, unit and meaning.

The key names are the user-facing contract of DESIGN.md. Fields documented here render into
`dsforge schema` (a JSON Schema for editors) and `docs/job-file.md`. Values a preset can
supply are validated after the preset is merged underneath the user's keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema
from pydantic_core import PydanticCustomError

PosInt = Annotated[StrictInt, Field(ge=1)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


def _degree(value: Any) -> Any:
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise PydanticCustomError("degree_type", "must be a whole number >= 1 or `auto`", {"value": value})
    if value < 1:
        raise PydanticCustomError("degree_range", "must be >= 1 or `auto`", {"value": value})
    return value


#: A parallel degree: a whole number >= 1, or "auto" to let dsforge choose it.
Degree = Annotated[
    int | str,
    BeforeValidator(_degree),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]}),
]


class Section(BaseModel):
    """Base of every section: unknown keys are errors (reported with a "did you mean")."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, defer_build=True)


class MoESpec(Section):
    """Mixture-of-experts layers (Shazeer et al. 2017): how many experts, how tokens are routed to them."""

    experts: PosInt = Field(description="Number of experts in each MoE layer.")
    top_k: PosInt = Field(2, description="Experts each token is routed to.")
    ffn_hidden: PosInt | None = Field(None, description="Hidden size of one expert's MLP; default: model.ffn_hidden.")
    every: PosInt = Field(1, description="An MoE layer every this many layers (1: every layer).")
    capacity_factor: PosFloat = Field(1.0, description="Expert capacity as a multiple of the even share of tokens.")


class ModelSpec(Section):
    """The transformer: a preset and/or its shape; keys written here override the preset's."""

    preset: str | None = Field(None, description="A model preset (`dsforge presets`); keys below override it.")
    arch: Literal["gpt2", "llama", "mixtral", "custom", "auto"] = Field(
        "auto", description="Rewrite policy: gpt2 | llama | mixtral | custom (uses `rewrite:`) | auto (detect).")
    layers: PosInt = Field(description="Number of transformer layers.")
    hidden: PosInt = Field(description="Model (embedding) width.")
    heads: PosInt = Field(description="Attention (query) heads.")
    kv_heads: PosInt | None = Field(None, description="Key/value heads (GQA); default: heads.")
    ffn_hidden: PosInt | None = Field(None, description="MLP inner width; default: 4 x hidden.")
    vocab: PosInt = Field(description="Vocabulary size (tokens).")
    seq_len: PosInt = Field(description="Sequence length of a training sample (tokens).")
    tied_embeddings: StrictBool = Field(False, description="The LM head shares the input embedding's weight.")
    activation: Literal["gelu", "swiglu"] | None = Field(
        None, description="MLP type: gelu (2 matrices) or swiglu (3 matrices); default by arch.")
    position: Literal["learned", "rope"] | None = Field(
        None, description="Position encoding: learned table (seq_len x hidden) or rope; default by arch.")
    vocab_multiple_of: PosInt | None = Field(
        None, description="Pad the vocabulary to a multiple of this x tp (Megatron's make-vocab-size-divisible-by).")
    moe: MoESpec | None = Field(None, description="Mixture-of-experts layers; absent for a dense model.")
    factory: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`package.module:callable` returning the nn.Module (runtime only).")


class AcceleratorSpec(Section):
    """One accelerator (GPU): its memory, peak throughput per precision and memory bandwidth."""

    name: str = Field(description="Accelerator model, e.g. H100-SXM5-80GB.")
    memory_gb: PosFloat = Field(description="Device memory per accelerator (GB, 1e9 bytes).")
    bf16_tflops: NonNegFloat = Field(description="Dense bf16 peak (TFLOP/s); 0 means bf16 is not supported.")
    fp16_tflops: NonNegFloat | None = Field(None, description="Dense fp16 peak (TFLOP/s); default: bf16_tflops.")
    fp32_tflops: NonNegFloat | None = Field(None, description="fp32 (TF32 where it applies) peak (TFLOP/s).")
    hbm_gbs: PosFloat = Field(description="Device memory bandwidth (GB/s).")
    achievable_fraction: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="Fraction of peak a well-tuned transformer step reaches (step-time model).")


class LinkSpec(Section):
    """A communication link as seen by one GPU: bandwidth per direction and one-message latency."""

    bandwidth_gbs: PosFloat = Field(description="Unidirectional bandwidth per GPU (GB/s).")
    latency_us: NonNegFloat = Field(description="One-message latency (microseconds).")


class HardwareSpec(Section):
    """The machines: a preset and/or nodes, GPUs per node, the accelerator and the two link levels."""

    preset: str | None = Field(None, description="A hardware preset (`dsforge presets`); keys below override it.")
    nodes: PosInt = Field(1, description="Number of nodes (hosts).")
    gpus_per_node: PosInt = Field(description="Accelerators (ranks) per node; CPU processes for cpu-local.")
    accelerator: AcceleratorSpec
    intra_node: LinkSpec = Field(description="Link between accelerators of one node (NVLink, PCIe, shared memory).")
    inter_node: LinkSpec = Field(description="Link between nodes (InfiniBand, RoCE, Ethernet), per GPU.")


class ContextParallelSpec(Section):
    """How context parallelism shares one sequence between ranks."""

    kind: Literal["ring", "ulysses"] = Field("ring", description="ring: K/V exchanged in a ring; ulysses: all-to-all.")


class PipelineSpec(Section):
    """The pipeline schedule and how layers are split into stages."""

    schedule: Literal["gpipe", "1f1b", "interleaved"] = Field("1f1b", description="Pipeline schedule.")
    virtual_stages: PosInt = Field(1, description="Model chunks per pipeline rank (interleaved schedule).")
    partition: Literal["parameters", "uniform"] | list[PosInt] = Field(
        "parameters", description="Layer split: balance parameters, uniform, or layers per stage (a list).")


class ParallelSpec(Section):
    """The parallel layout: degrees, ZeRO stage, sequence/context parallelism, pipeline and rank order."""

    tp: Degree = Field(1, description="Tensor-parallel degree (ranks sharing each layer's matrices).")
    pp: Degree = Field(1, description="Pipeline-parallel degree (stages).")
    dp: Degree = Field("auto", description="Data-parallel degree; auto: world size / (tp x pp x cp).")
    cp: Degree = Field(1, description="Context-parallel degree (ranks sharing one sequence).")
    ep: Degree = Field(1, description="Expert-parallel degree (carved out of dp x cp).")
    zero: Annotated[StrictInt, Field(ge=0, le=3)] | Literal["auto"] = Field(
        0, description="ZeRO stage 0-3 (Rajbhandari et al. 2020).")
    sequence_parallel: StrictBool = Field(False, description="Megatron sequence parallelism inside the TP group.")
    replicate_kv_heads: StrictBool = Field(
        False, description="Allow tp > kv_heads by replicating KV heads (tp must be a multiple of kv_heads).")
    context_parallel: ContextParallelSpec = Field(default_factory=ContextParallelSpec)
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    order: str = Field("tp-cp-ep-dp-pp", description="Rank placement, fastest-varying axis first (Megatron).")


class OptimizerSpec(Section):
    """The optimizer and where ZeRO keeps its states."""

    name: Literal["adamw", "adam", "sgd", "lion", "lamb"] = Field("adamw", description="Optimizer.")
    lr: PosFloat = Field(3.0e-4, description="Peak learning rate.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.95), description="Adam-family momentum coefficients.")
    eps: PosFloat = Field(1.0e-8, description="Adam epsilon.")
    weight_decay: NonNegFloat = Field(0.0, description="Decoupled weight decay.")
    offload: Literal["none", "cpu", "nvme"] = Field("none", description="Where ZeRO keeps optimizer states.")


class SchedulerSpec(Section):
    """The learning-rate schedule."""

    name: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: NonNegInt = Field(0, description="Linear warm-up (optimizer steps).")
    min_lr: NonNegFloat = Field(0.0, description="Learning rate at the end of the decay.")


class DataSpec(Section):
    """Training data: synthetic tokens, or a flat token file."""

    kind: Literal["synthetic", "tokens"] = Field("synthetic", description="synthetic or a token file.")
    path: str | None = Field(None, description="Token file (flat uint16/uint32 array) for kind: tokens.")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of the token file.")


class CheckpointSpec(Section):
    """Where and how often checkpoints are written, and whether a run resumes."""

    dir: str = Field("checkpoints", description="Checkpoint directory (relative to the job directory).")
    every: NonNegInt = Field(0, description="Save every this many optimizer steps (0: only at the end).")
    resume: Literal["auto", "never"] = Field("auto", description="auto: resume from the latest checkpoint.")


class TrainingSpec(Section):
    """Batch sizes, precision, recomputation, optimizer, schedule, data and checkpoints."""

    global_batch: PosInt = Field(8, description="Sequences per optimizer step, over all data-parallel ranks.")
    micro_batch: PosInt = Field(1, description="Sequences per rank per forward/backward pass.")
    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Compute precision.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation (Korthikanti et al. 2022).")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    grad_clip: NonNegFloat = Field(1.0, description="Gradient-norm clipping (0: off).")
    steps: PosInt = Field(1000, description="Optimizer steps to train.")
    seed: NonNegInt = Field(1234, description="Random seed.")
    data: DataSpec = Field(default_factory=DataSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)


#: Launchers dsforge ships; installed plugins can add launch targets (entry points `dsforge.launchers`).
BUILTIN_LAUNCHERS: tuple[str, ...] = ("local", "deepspeed", "torchrun", "slurm", "kubernetes", "accelerate")


def _launcher(value: Any) -> Any:
    if isinstance(value, str) and value in BUILTIN_LAUNCHERS:
        return value
    names = list(BUILTIN_LAUNCHERS)
    if isinstance(value, str):
        from dsforge.plugins.extensions import launch_target_names

        plugins = launch_target_names()  # read only for a name dsforge does not ship: start-up stays lean
        if value in plugins:
            return value
        names += plugins
    # Reported as a literal error, so a misspelt launcher gets the same "did you mean" as any other choice.
    expected = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


#: A launcher: a built-in one or a plugin's launch target.
Launcher = Annotated[
    str,
    BeforeValidator(_launcher),
    WithJsonSchema({"anyOf": [{"enum": list(BUILTIN_LAUNCHERS)},
                              {"type": "string", "description": "a launch target of an installed plugin"}]}),
]


class RewriteRule(Section):
    """One module-rewrite rule: modules whose name matches become this parallel variant."""

    match: str = Field(description="Regular expression over qualified module names.")
    as_: Literal["column", "row", "vocab", "replicate", "expert"] = Field(
        alias="as", description="Parallel variant of the matched modules.")
    fused: PosInt = Field(1, description="The weight fuses this many equal blocks (3 for a fused QKV).")


class LaunchSpec(Section):
    """How the compiled job is started: the launcher and its settings."""

    launcher: Launcher = Field(
        "local", description="How the job is started (accelerate: `accelerate launch` with accelerate_config.yaml; "
                             "any other name: the launch target of an installed plugin).")
    master_addr: str = Field("127.0.0.1", description="Rendezvous host (multi-node).")
    master_port: Annotated[StrictInt, Field(ge=1, le=65535)] = Field(29500, description="Rendezvous port.")
    image: str | None = Field(None, description="Container image (kubernetes).")
    namespace: str = Field("default", description="Kubernetes namespace.")
    partition: str | None = Field(None, description="SLURM partition.")
    account: str | None = Field(None, description="SLURM account.")
    time_limit: str | None = Field(None, description="SLURM time limit, e.g. 24:00:00.")
    python: str = Field("python", description="Python interpreter on the nodes.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for every rank.")
    hosts: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")]] = Field(
        default_factory=list,
        description="Host names of the nodes, one per node (deepspeed launcher's hostfile); default for one node: "
                    "localhost.")
    rdzv_backend: Literal["c10d", "static"] = Field(
        "c10d", description="torchrun rendezvous across nodes: c10d (any node may start first) or static "
                            "(each node needs NODE_RANK).")
    gpu_resource: str = Field(
        "nvidia.com/gpu", pattern=r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$",
        description="Kubernetes extended-resource name of one accelerator, requested gpus_per_node times per pod.")


class JobSpec(Section):
    """A whole job file (format version 1)."""

    version: Literal[1] = Field(description="Job-file format version.")
    name: str = Field("job", min_length=1, description="Job name (used in file and queue names).")
    model: ModelSpec
    hardware: HardwareSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    rewrite: list[RewriteRule] = Field(default_factory=list, description="Extra rewrite rules (custom models).")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="Raw ds_config overrides, merged last.")
    launch: LaunchSpec = Field(default_factory=LaunchSpec)
