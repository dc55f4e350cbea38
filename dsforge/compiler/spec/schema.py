"""The typed job spec (format version 1): every key of a job file, its type, unit and meaning.

The key names are the user-facing contract of DESIGN.md. Fields documented here render into
`dsforge schema` (a JSON Schema for editors) and `docs/job-file.md`. Values a preset can
supply are validated after the preset is merged underneath the user's keys.
"""

from __future__ import annotations

from typing import Any, Literal

from dsforge.compiler.launch_targets import BUILTIN_LAUNCHERS, launch_target_names
from dsforge.compiler.spec.spec_types import (
    BAD,
    AnyOf,
    Bool,
    Choice,
    Float,
    Int,
    Issue,
    Kind,
    ListOf,
    MappingOf,
    Nested,
    Optional,
    Path,
    Section,
    Str,
    TupleOf,
    field,
    section,
)

POS_INT, NON_NEG_INT = Int(ge=1), Int(ge=0)
POS_FLOAT, NON_NEG_FLOAT = Float(gt=0), Float(ge=0)

# Upper bounds of every size. Each lies far above the largest published model or cluster, so no real job
# meets one, while every check and estimate stays bounded in time and memory on any input (a divisor search,
# a per-layer loop, a rank placement) and every product of sizes stays a finite float.
#: Layers: the deepest published dense models have ~126 (Llama 3 405B); 10,000 is ~80x that.
MAX_LAYERS = 10_000
#: Model width: 16,384-18,432 in the widest models (Llama 3 405B, PaLM 540B); 2^20 is ~60x.
MAX_HIDDEN = 2**20
#: MLP width: 53,248-73,728 (Llama 3 405B, PaLM 540B); 2^22 (4 x MAX_HIDDEN) is ~60x.
MAX_FFN = 2**22
#: Attention heads (and KV heads): 128 in the largest models; 2^16.
MAX_HEADS = 2**16
#: Width of one attention head: 64-256 in published models (Gemma 2/3 use 256); 2^16 is 256x.
MAX_HEAD_DIM = 2**16
#: Vocabulary: 256,000 tokens (Gemma); 2^24 is ~65x.
MAX_VOCAB = 2**24
#: Sequence: 10M tokens (Llama 4 Scout's context); 2^27 (134M) is ~13x.
MAX_SEQ_LEN = 2**27
#: Experts per MoE layer: 256-384 in production (DeepSeek-V3, Kimi K2), ~1M in PEER (He 2024); 2^22 is 4x
#: that.
MAX_EXPERTS = 2**22
#: Experts per token: 8-16 in production, 128 (8 heads x 16) in PEER; 2^16.
MAX_TOP_K = 2**16
#: Ranks in one job (nodes x gpus_per_node, and any degree): ~200,000 GPUs in the largest clusters (xAI
#: Colossus); 2^20 is ~5x. Placement, groups and plan.json grow with it.
MAX_WORLD = 2**20
#: Accelerators per node: 8 in a DGX, 72 in an NVL72 rack treated as one node; 2^16 is far above.
MAX_GPUS_PER_NODE = 2**16
#: Pipeline stages and model chunks per rank: 64 stages in the deepest published pipelines (Megatron's 1T
#: run); 1,024 is 16x. The event simulation of the schedule grows with them.
MAX_STAGES = 1024
#: Sequences per step, and per micro-batch: ~1,000-16,000 in real runs; 2^40 leaves a factor of 2^26.
MAX_BATCH = 2**40
#: Optimizer steps (and warm-up, checkpoint interval): ~10^6 in real runs; 2^40.
MAX_STEPS = 2**40
#: Peak TFLOP/s per accelerator: ~2,250 dense bf16 (B200); 10^6 TFLOP/s (an exaFLOP/s) is ~400x. Below 10^-6
#: (one MFLOP/s) a pass would take longer than any estimate can state.
MAX_TFLOPS, MIN_TFLOPS = 1e6, 1e-6
#: Bandwidths (GB/s): HBM ~8,000 (B200), links ~900 (NVLink 5); 10^7 GB/s is >1000x. At least 10^-6 GB/s (1
#: KB/s).
MAX_GBS, MIN_GBS = 1e7, 1e-6
#: Memory per accelerator (GB): 288 GB (B300); 10^6 GB (a petabyte) is >3000x; at least 10^-3 GB (1 MB).
MAX_MEMORY_GB, MIN_MEMORY_GB = 1e6, 1e-3

TFLOPS = Float(ge=0, le=MAX_TFLOPS, min_nonzero=MIN_TFLOPS)
GBS = Float(ge=MIN_GBS, le=MAX_GBS)

#: A parallel degree: a whole number >= 1 (at most MAX_WORLD), or "auto" to let dsforge choose it.
DEGREE = AnyOf(Int(ge=1, le=MAX_WORLD), Choice("auto"),
               expected=f"a whole number from 1 to {MAX_WORLD} or `auto`",
               schema={"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_WORLD}, {"const": "auto"}]})
PP_DEGREE = AnyOf(Int(ge=1, le=MAX_STAGES), Choice("auto"),
                  expected=f"a whole number from 1 to {MAX_STAGES} or `auto`",
                  schema={"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_STAGES},
                                    {"const": "auto"}]})


class MoESpec(Section):
    """Mixture-of-experts layers (Shazeer et al. 2017): how many experts, how tokens are routed to them."""

    experts: int = field(Int(ge=1, le=MAX_EXPERTS), description="Number of experts in each MoE layer.")
    top_k: int = field(Int(ge=1, le=MAX_TOP_K), 2, "Experts each token is routed to.")
    ffn_hidden: int | None = field(Optional(Int(ge=1, le=MAX_FFN)), None,
                                   "Hidden size of one expert's MLP; default: model.ffn_hidden.")
    every: int = field(Int(ge=1, le=MAX_LAYERS), 1, "An MoE layer every this many layers (1: every layer).")
    # 1.0-2.0 in practice; above experts / top_k every expert takes every token, so 10^4 is plenty
    capacity_factor: float = field(Float(gt=0, le=1e4), 1.0,
                                   "Expert capacity as a multiple of the "
                                   "even share of tokens (with drop_tokens).")
    drop_tokens: bool = field(Bool(), False, "Drop the tokens over an expert's capacity (DeepSpeed's gate; "
                                             "needs ep > 1); false: dropless, "
                                             "every expert takes all its tokens.")
    shared_experts: int = field(Int(ge=0, le=MAX_EXPERTS), 0,
                                "Dense experts every token passes through "
                                "beside the routed ones (Qwen2-MoE, DeepSeek).")
    shared_ffn_hidden: int | None = field(Optional(Int(ge=1, le=MAX_FFN)), None,
                                          "Hidden size of one shared expert's MLP; default: moe.ffn_hidden.")


class ModelSpec(Section):
    """The transformer: a preset and/or its shape; keys written here override the preset's."""

    preset: str | None = field(Optional(Str()), None, "A model preset (`dsforge "
                                                      "presets`); keys below override it.")
    pretrained: str | None = field(
        Optional(Str(min_length=1)), None,
        "An HF model directory (config.json + safetensors): fills the keys below from config.json and "
        "loads each rank's slices of its weights.")
    arch: Literal["gpt2", "llama", "mixtral", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "gpt_neox",
                  "qwen2_moe", "qwen3_moe", "deepseek_v3", "custom", "auto"] = field(
        Choice("gpt2", "llama", "mixtral", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "gpt_neox",
               "qwen2_moe", "qwen3_moe", "deepseek_v3", "custom", "auto"), "auto",
        "Rewrite policy: gpt2 | llama (also Mistral, Qwen2) | mixtral | qwen3 | gemma2 | gemma3 | olmo2 | "
        "phi3 | gpt_neox | qwen2_moe | qwen3_moe | deepseek_v3 (these need model.factory or "
        "model.pretrained) | custom (uses `rewrite:`) | auto (detect).")
    layers: int = field(Int(ge=1, le=MAX_LAYERS), description="Number of transformer layers.")
    hidden: int = field(Int(ge=1, le=MAX_HIDDEN), description="Model (embedding) width.")
    heads: int = field(Int(ge=1, le=MAX_HEADS), description="Attention (query) heads.")
    kv_heads: int | None = field(Optional(Int(ge=1, le=MAX_HEADS)), None,
                                 "Key/value heads (GQA); default: heads.")
    head_dim: int | None = field(
        Optional(Int(ge=1, le=MAX_HEAD_DIM)), None,
        "Width of one attention head (Q/O are hidden x heads*head_dim, K/V hidden x kv_heads*head_dim); "
        "default: hidden / heads.")
    qkv_bias: bool | None = field(
        Optional(Bool()), None,
        "The q, k and v projections carry biases (Qwen2, Qwen2-MoE); default by arch (gpt2 and gpt_neox: "
        "their fused QKV has one; qwen2_moe: true; others: false).")
    ffn_hidden: int | None = field(Optional(Int(ge=1, le=MAX_FFN)), None,
                                   "MLP inner width; default: 4 x hidden.")
    vocab: int = field(Int(ge=1, le=MAX_VOCAB), description="Vocabulary size (tokens).")
    seq_len: int = field(Int(ge=1, le=MAX_SEQ_LEN),
                         description="Sequence length of a training sample (tokens).")
    tied_embeddings: bool = field(Bool(), False, "The LM head shares the input embedding's weight.")
    activation: Literal["gelu", "swiglu"] | None = field(
        Optional(Choice("gelu", "swiglu")), None,
        "MLP type: gelu (2 matrices) or swiglu (3 matrices); default by arch.")
    position: Literal["learned", "rope"] | None = field(
        Optional(Choice("learned", "rope")), None,
        "Position encoding: learned table (seq_len x hidden) or rope; default by arch.")
    vocab_multiple_of: int | None = field(
        Optional(Int(ge=1, le=MAX_VOCAB)), None,
        "Pad the vocabulary to a multiple of this x tp (Megatron's make-vocab-size-divisible-by).")
    moe: MoESpec | None = field(Optional(Nested(MoESpec)), None,
                                "Mixture-of-experts layers; absent for a dense model.")
    factory: str | None = field(
        Optional(Str(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")), None,
        "`package.module:callable` returning the nn.Module (runtime only).")


class AcceleratorSpec(Section):
    """One accelerator (GPU): its memory, peak throughput per precision and memory bandwidth."""

    name: str = field(Str(), description="Accelerator model, e.g. H100-SXM5-80GB.")
    memory_gb: float = field(Float(ge=MIN_MEMORY_GB, le=MAX_MEMORY_GB),
                             description="Device memory per accelerator (GB, 1e9 bytes).")
    bf16_tflops: float = field(TFLOPS, description="Dense bf16 peak (TFLOP/s); 0 means bf16 is not supported "
                                                   "(else at least 1e-6).")
    fp16_tflops: float | None = field(Optional(TFLOPS), None,
                                      "Dense fp16 peak (TFLOP/s; 0, or at least 1e-6); default: bf16_tflops.")
    fp32_tflops: float | None = field(Optional(TFLOPS), None,
                                      "fp32 (TF32 where it applies) peak (TFLOP/s; 0, or at least 1e-6).")
    fp8_tflops: float | None = field(
        Optional(TFLOPS),
        None,
        "Dense FP8 Tensor Core peak (TFLOP/s; 0 or absent: no FP8), "
        "the rate of precision fp8's linear layers.",
    )
    hbm_gbs: float = field(GBS, description="Device memory bandwidth (GB/s).")
    # real kernels reach 0.3-0.7 of peak; below 10^-3 no estimate would mean anything
    achievable_fraction: float | None = field(
        Optional(Float(ge=1e-3, le=1)), None,
        "Override: every FLOP of the step at this fraction of peak (replaces the GEMM/memory model below).")
    # cuBLAS reaches 0.6-0.8 of dense peak on large bf16 GEMMs; a CPU BLAS 0.2-0.9 of its stated peak
    gemm_efficiency: float | None = field(
        Optional(Float(ge=1e-3, le=1)), None,
        "Fraction of dense peak a large matrix multiply reaches (measure it: `dsforge calibrate`).")
    memory_efficiency: float | None = field(
        Optional(Float(ge=1e-3, le=1)), None,
        "Fraction of hbm_gbs that memory-bound kernels (norms, activations, optimizer) reach; default 0.8.")
    # ~2-5 us per CUDA kernel launch, 5-50 us per eager op on a CPU; 1 s per op would be absurd
    op_overhead_us: float | None = field(
        Optional(Float(ge=0, le=1e6)), None,
        "Fixed cost of one framework operation (dispatch and launch, microseconds); default 0.")


class LinkSpec(Section):
    """A communication link as seen by one GPU: bandwidth per direction and one-message latency."""

    bandwidth_gbs: float = field(GBS, description="Unidirectional bandwidth per GPU (GB/s).")
    # ~1-100 us on real links; 10^9 us is a quarter of an hour per message
    latency_us: float = field(Float(ge=0, le=1e9), description="One-message latency (microseconds).")
    # NCCL reaches ~0.8 of NVLink's line rate (protocol overhead), ~0.9 of InfiniBand's
    bus_efficiency: float | None = field(
        Optional(Float(ge=1e-3, le=1)), None,
        "Share of bandwidth_gbs a collective's bus bandwidth reaches (NCCL busbw / line rate); default 1.")


#: One figure per ZeRO stage 0-3, microseconds; 10^7 us (10 s) per call would be absurd
_PER_ZERO_US = TupleOf(*(Float(ge=0, le=1e7) for _ in range(4)))


class EngineOverheadSpec(Section):
    """Host time the DeepSpeed engine spends outside the model's own operations, per ZeRO stage 0-3."""

    step_us: tuple[float, float, float, float] = field(
        _PER_ZERO_US, (0.0, 0.0, 0.0, 0.0),
        "Fixed cost of one optimizer step (gradient-accumulation boundary), per ZeRO stage 0-3 (us).")
    micro_batch_us: tuple[float, float, float, float] = field(
        _PER_ZERO_US, (0.0, 0.0, 0.0, 0.0),
        "Fixed cost of one micro-batch's engine forward, backward and step calls, per ZeRO stage 0-3 (us).")
    tensor_step_us: tuple[float, float, float, float] = field(
        _PER_ZERO_US, (0.0, 0.0, 0.0, 0.0),
        "Cost per parameter tensor of a rank per optimizer step (the optimizer tensor by tensor, "
        "flattening), per ZeRO stage 0-3 (us).")
    tensor_micro_batch_us: tuple[float, float, float, float] = field(
        _PER_ZERO_US, (0.0, 0.0, 0.0, 0.0),
        "Cost per parameter tensor of a rank per micro-batch (gradient hooks and bucketing, ZeRO-3's fetch "
        "and release), per ZeRO stage 0-3 (us).")


class HardwareSpec(Section):
    """The machines: a preset and/or nodes, GPUs per node, the accelerator and the two link levels."""

    preset: str | None = field(
        Optional(Str()), None,
        "A hardware preset (`dsforge presets`), or a hardware file's path (with `/` or a .yaml/.yml suffix, "
        "relative to the file that writes it; e.g. what `dsforge calibrate` writes); keys below override it.")
    # `auto`: resolved by the layout search before any plan is built (validate), so the code after it sees the
    # value
    nodes: int = field(AnyOf(Int(ge=1, le=MAX_WORLD), Choice("auto")), 1,
                             f"Number of nodes (hosts); nodes x gpus_per_node is at most {MAX_WORLD}; auto: "
                             f"the fewest that meet `search.deadline_hours` (objective min_gpus).")
    gpus_per_node: int = field(Int(ge=1, le=MAX_GPUS_PER_NODE),
                               description="Accelerators (ranks) per node; CPU processes for cpu-local.")
    accelerator: AcceleratorSpec = field(Nested(AcceleratorSpec),
                                         description="The accelerator of every rank.")
    intra_node: LinkSpec = field(
        Nested(LinkSpec), description="Link between accelerators of one node (NVLink, PCIe, shared memory).")
    inter_node: LinkSpec = field(Nested(LinkSpec),
                                 description="Link between nodes (InfiniBand, RoCE, Ethernet), per GPU.")
    host_ram_gb: float | None = field(Optional(Float(ge=MIN_MEMORY_GB, le=MAX_MEMORY_GB)), None,
                                      "Host (CPU) memory per node (GB); "
                                      "offloaded states are checked against it.")
    host_link_gbs: float | None = field(Optional(GBS), None,
                                        "Host-to-device bandwidth per accelerator "
                                        "(GB/s, PCIe); prices offload.")
    host_cores: int | None = field(Optional(Int(ge=1, le=MAX_GPUS_PER_NODE)), None,
                                   "CPU cores per node; on the cpu accelerator, "
                                   "ranks beyond them time-share the cores.")
    engine_overhead: EngineOverheadSpec | None = field(
        Optional(Nested(EngineOverheadSpec)), None,
        "DeepSpeed engine host time per step, micro-batch and parameter tensor (stack dsforge; measured by "
        "`dsforge calibrate`); absent: not priced.")

    @classmethod
    def _relations(cls, values: dict[str, Any], path: Path, issues: list[Issue]) -> None:
        nodes, per = values["nodes"], values["gpus_per_node"]
        if isinstance(nodes, int) and nodes * per > MAX_WORLD:
            issues.append(Issue((*path, "nodes"), "range", f"at most {max(1, MAX_WORLD // per)} with {per} "
                                f"GPUs per node (nodes x gpus_per_node <= {MAX_WORLD} ranks)", nodes))


class ContextParallelSpec(Section):
    """How context parallelism shares one sequence between ranks."""

    # `auto`: resolved by the layout search before any plan is built (validate), so the code after it sees the
    # value
    kind: Literal["ring", "ulysses"] = field(
        Choice("ring", "ulysses", "auto"), "ring", "ring: K/V exchanged in a ring; ulysses: all-to-all; "
                                                    "auto: the search chooses.")


class PipelineSpec(Section):
    """The pipeline schedule and how layers are split into stages."""

    # `auto` (here and in virtual_stages): resolved by the layout search before any plan is built (validate),
    # so the code after it sees the value
    schedule: Literal["gpipe", "1f1b", "interleaved"] = field(
        Choice("gpipe", "1f1b", "interleaved", "auto"), "1f1b",
        "Pipeline schedule (auto: the search chooses).")
    virtual_stages: int = field(AnyOf(Int(ge=1, le=MAX_STAGES), Choice("auto")), 1,
                                      "Model chunks per pipeline rank (interleaved "
                                      "schedule); auto: the search chooses.")
    partition: Literal["parameters", "uniform", "type:transformer"] | list[int] = field(
        AnyOf(Choice("parameters", "uniform", "type:transformer"), ListOf(Int(ge=1, le=MAX_LAYERS))),
        "parameters", "Layer split: balance parameters, uniform, balance transformer layers only "
        "(DeepSpeed's type:transformer, Megatron-DeepSpeed's default), or layers per stage (a list).")
    # Megatron-Core's uneven pipeline (--decoder-first/last-pipeline-num-layers): the ends get their own
    # counts
    first_stage_layers: int | None = field(
        Optional(Int(ge=1, le=MAX_LAYERS)), None,
        "Layers of the first pipeline stage (Megatron-Core's decoder_first_pipeline_num_layers); the stages "
        "without a count share the rest evenly.")
    last_stage_layers: int | None = field(
        Optional(Int(ge=1, le=MAX_LAYERS)), None,
        "Layers of the last pipeline stage (Megatron-Core's decoder_last_pipeline_num_layers).")
    # Megatron-Core's --account-for-embedding/loss-in-pipeline-split (transformer_block.py
    # get_num_layers_to_build)
    account_for_embedding: bool = field(
        Bool(), False, "Count the embedding as one layer of the first stage when splitting (Megatron-Core's "
        "account_for_embedding_in_pipeline_split; stack megatron-te).")
    account_for_loss: bool = field(
        Bool(), False, "Count the loss as one layer of the last stage when splitting (Megatron-Core's "
        "account_for_loss_in_pipeline_split; stack megatron-te).")


class ParallelSpec(Section):
    """The parallel layout: degrees, ZeRO stage, sequence/context parallelism, pipeline and rank order."""

    tp: int | str = field(DEGREE, 1, "Tensor-parallel degree (ranks sharing each layer's matrices).")
    pp: int | str = field(PP_DEGREE, 1, "Pipeline-parallel degree (stages).")
    dp: int | str = field(DEGREE, "auto", "Data-parallel degree; auto: world size / (tp x pp x cp).")
    cp: int | str = field(DEGREE, 1, "Context-parallel degree (ranks sharing one sequence).")
    ep: int | str = field(DEGREE, 1, "Expert-parallel degree (carved out of dp x cp).")
    zero: int | str = field(AnyOf(Int(ge=0, le=3), Choice("auto")), 0,
                            "ZeRO stage 0-3 (Rajbhandari et al. 2020).")
    # `auto`: resolved by the layout search before any plan is built (validate), so the code after it sees the
    # value
    sequence_parallel: bool = field(AnyOf(Bool(), Choice("auto")), False,
                                          "Megatron sequence parallelism inside the "
                                          "TP group (auto: the search chooses).")
    replicate_kv_heads: bool = field(
        Bool(), False, "Allow tp > kv_heads by replicating KV heads (tp must be a multiple of kv_heads).")
    context_parallel: ContextParallelSpec = section(ContextParallelSpec,
                                                    "How context parallelism shares a sequence.")
    pipeline: PipelineSpec = section(PipelineSpec, "The pipeline schedule and stage split.")
    order: str = field(Str(), "tp-cp-ep-dp-pp", "Rank placement, fastest-varying axis first (Megatron).")


class OptimizerSpec(Section):
    """The optimizer and where ZeRO keeps its states."""

    name: Literal["adamw", "adam", "sgd", "lion", "lamb"] = field(
        Choice("adamw", "adam", "sgd", "lion", "lamb"), "adamw", "Optimizer.")
    lr: float = field(POS_FLOAT, 3.0e-4, "Peak learning rate.")
    betas: tuple[float, float] = field(
        TupleOf(Float(ge=0, lt=1), Float(ge=0, lt=1)), (0.9, 0.95), "Adam-family momentum coefficients.")
    eps: float = field(POS_FLOAT, 1.0e-8, "Adam epsilon.")
    weight_decay: float = field(NON_NEG_FLOAT, 0.0, "Decoupled weight decay.")
    offload: Literal["none", "cpu", "nvme"] = field(
        Choice("none", "cpu", "nvme"), "none", "Where ZeRO keeps optimizer states.")


class SchedulerSpec(Section):
    """The learning-rate schedule."""

    name: Literal["cosine", "linear", "constant"] = field(
        Choice("cosine", "linear", "constant"), "cosine", "Decay after warm-up.")
    warmup_steps: int = field(Int(ge=0, le=MAX_STEPS), 0, "Linear warm-up (optimizer steps).")
    min_lr: float = field(NON_NEG_FLOAT, 0.0, "Learning rate at the end of the decay.")


class ValidSpec(Section):
    """Validation data and how often its loss is computed (dsforge.runtime.datasets.validation)."""

    path: str | None = field(Optional(Str()), None, "Validation files, read as training.data reads its path "
                                                    "(same kind, field and tokenizer); "
                                                    "unset: a held-out fraction.")
    fraction: float | None = field(Optional(Float(gt=0, lt=1)), None,
                                   "Share of the training sequences held "
                                   "out for validation (instead of a path).")
    every: int = field(Int(ge=1, le=MAX_STEPS), 100, "Compute the validation loss "
                                                     "every this many optimizer steps.")
    batches: int = field(Int(ge=1, le=2**20), 8, "Fixed global batches the validation loss averages over.")


class DataSpec(Section):
    """Training data: synthetic tokens, a flat token file, text/JSONL/Parquet/HF datasets, or Megatron
    datasets."""

    kind: Literal["synthetic", "tokens", "text", "megatron"] = field(
        Choice("synthetic", "tokens", "text", "megatron"), "synthetic",
        "synthetic; tokens (a flat token file); text (.jsonl/.json/.parquet/.txt files, a directory or glob "
        "of them, or an HF datasets directory); megatron (the prefix of .bin/.idx indexed datasets).")
    path: str | list[str] | None = field(
        Optional(AnyOf(Str(), ListOf(Str()), expected="a path or a list of paths")), None,
        "Token file (kind: tokens), text files, a directory or glob (kind: text), or .bin/.idx prefixes "
        "(kind: megatron; a list blends them by `weights`); a "
        "relative path is taken from the job file's directory.")
    dtype: Literal["uint16", "uint32"] = field(Choice("uint16", "uint32"), "uint16",
                                               "Element type of the token file.")
    field_: str | None = field(
        Optional(Str(min_length=1)),
        None,
        "The record's field holding the text (default: text) "
        "or, for format: chat, the messages (default: messages).",
        alias="field",
    )
    format: Literal["text", "chat"] = field(
        Choice("text", "chat"), "text", "text: plain documents; chat: lists of {role, content} messages "
                                        "rendered with the tokenizer's chat template, "
                                        "the loss on assistant tokens only.")
    tokenizer: str = field(Str(min_length=1), "auto", "auto: model.pretrained's own tokenizer "
                                                     "(tokenizer.json next to config.json); or a tokenizer "
                                                     "directory or tokenizer.json file.")
    packing: bool | str = field(
        AnyOf(Bool(), Choice("concat"), expected="true, false or `concat`"), True,
        "true: documents packed to seq_len with EOS between them, positions and attention not crossing "
        "documents; concat: packed, attention crossing documents (Megatron's "
        "default); false: one document per sequence, padded.")
    weights: list[float] = field(ListOf(Float(gt=0, le=1e18)), factory=list,
                                 description="Blending weights of several megatron prefixes, one per path.")
    valid: ValidSpec | None = field(Optional(Nested(ValidSpec)), None, "Validation loss every N steps.")


class MonitorSpec(Section):
    """DeepSpeed's `monitor` writers: the loss, learning rate, throughput and validation loss of every
    step."""

    tensorboard: bool = field(Bool(), False, "TensorBoard event files under `dir` "
                                             "(needs the tensorboard package).")
    csv: bool = field(Bool(), False, "DeepSpeed's csv_monitor: one CSV file per scalar under `dir`.")
    wandb: bool = field(Bool(), False, "Weights & Biases (needs wandb, installed and logged in).")
    dir: str = field(Str(min_length=1), "monitor", "Where TensorBoard and CSV files go; relative: inside the "
                                                    "job directory.")


class CheckpointSpec(Section):
    """Where and how often checkpoints are written, and whether a run resumes."""

    dir: str = field(Str(), "checkpoints", "Checkpoint directory; a relative path written in the job file is "
                                           "taken from the job file's directory, the "
                                           "default lies inside the job directory.")
    every: int = field(Int(ge=0, le=MAX_STEPS), 0, "Save every this many optimizer "
                                                   "steps (0: only at the end).")
    resume: Literal["auto", "never"] = field(Choice("auto", "never"), "auto",
                                             "auto: resume from the latest checkpoint.")
    # h26 (issue 26): integrity and retention, dsforge/runtime/checkpoint_manifest.py and retention.py
    if_damaged: Literal["refuse", "fall_back"] = field(
        Choice("refuse", "fall_back"), "refuse",
        "A checkpoint whose manifest check fails at resume (a file changed, truncated or missing): refuse "
        "names the file and stops; fall_back resumes from the newest intact checkpoint instead and says so.")
    keep: int | Literal["all"] = field(
        AnyOf(Int(ge=1, le=MAX_STEPS), Choice("all"),
              expected=f"a whole number from 1 to {MAX_STEPS} or `all`"), "all",
        "Complete checkpoints to keep: once a newer one has committed, older ones beyond this many are "
        "deleted (never the one `latest` names); all (the default) keeps every one.")


class KernelsSpec(Section):
    """dsforge's lean runtime kernels (dsforge.compiler.model.lean_kernels): auto runs each where it is exact
    for the model's family, true requires it (refused where it is not: DSF050), false runs the plain HF
    modules."""

    fused_loss: bool | str = field(AnyOf(Bool(), Choice("auto")), "auto",
                                   "Fused, chunked LM head + cross entropy: no full-vocabulary fp32 logits.")
    swiglu: bool | str = field(AnyOf(Bool(), Choice("auto")), "auto",
                               "SwiGLU that saves only gate and up (dense MLPs, "
                               "shared experts, routed experts at ep > 1).")
    gelu: bool | str = field(AnyOf(Bool(), Choice("auto")), "auto",
                             "GPT-2's gelu_new that saves only its input.")
    norm: bool | str = field(AnyOf(Bool(), Choice("auto")), "auto",
                             "HF's RMSNorm saving only its input and an fp32 rstd (no fp32 copy).")


class TrainingSpec(Section):
    """Batch sizes, precision, recomputation, optimizer, schedule, data and checkpoints."""

    global_batch: int = field(Int(ge=1, le=MAX_BATCH), 8, "Sequences per optimizer step, over all "
                                                          "data-parallel ranks.")
    # `auto` (here and in recompute): resolved by the layout search before any plan is built (validate), so
    # the code after it sees the value
    micro_batch: int = field(AnyOf(Int(ge=1, le=MAX_BATCH), Choice("auto")), 1,
                                   "Sequences per rank per forward/backward pass (auto: the search chooses).")
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = field(
        Choice("bf16", "fp16", "fp32", "fp8"), "bf16",
        "Compute precision; fp8: Transformer Engine's FP8 GEMMs "
        "with bf16 weights (stack megatron-te; see fp8_recipe).")
    fp8_recipe: Literal["delayed", "current", "blockwise", "mxfp8"] | None = field(
        Optional(Choice("delayed", "current", "blockwise", "mxfp8")), None,
        "Transformer Engine's FP8 scaling recipe with precision fp8 (delayed or current tensor scaling, "
        "blockwise, MXFP8); default: delayed.")
    grad_reduce: Literal["auto", "fp32", "bf16"] = field(
        Choice("auto", "fp32", "bf16"), "auto",
        "Dtype of the gradient buffer and its reduction: auto (the stack's default: fp32 under megatron-te "
        "with bf16, DeepSpeed's compute dtype otherwise), fp32, or bf16 (Megatron's --grad-reduce-in-bf16).")
    recompute: Literal["none", "selective", "full"] = field(
        Choice("none", "selective", "full", "auto"), "none",
        "Activation recomputation (Korthikanti et al. 2022); auto: the search chooses.")
    attention: Literal["auto", "flash", "unfused"] = field(
        Choice("auto", "flash", "unfused"), "auto",
        "The attention core's kernel: auto (the stack's own: TE's flash attention under megatron-te, "
        "Megatron's unfused softmax attention under megatron-deepspeed, SDPA under dsforge), flash, or "
        "unfused (s x s scores materialised: Megatron-LM before flash attention, --attention-backend "
        "unfused).")
    optimizer: OptimizerSpec = section(OptimizerSpec, "The optimizer and where ZeRO keeps its states.")
    scheduler: SchedulerSpec = section(SchedulerSpec, "The learning-rate schedule.")
    # 0.3-1.0 in practice; a huge threshold never clips but still reports the norm (0 turns clipping off); the
    # bound keeps the value finite through every product the estimates and DeepSpeed form with it
    grad_clip: float = field(Float(ge=0, le=1e18), 1.0, "Gradient-norm clipping (0: off).")
    steps: int = field(Int(ge=1, le=MAX_STEPS), 1000, "Optimizer steps to train.")
    # 32 bits: what every generator the runtime seeds accepts (numpy's takes no more)
    seed: int = field(Int(ge=0, le=2**32 - 1), 1234, "Random seed.")
    data: DataSpec = section(DataSpec, "Training data.")
    checkpoint: CheckpointSpec = section(CheckpointSpec, "Checkpoint directory, interval and resume.")
    monitor: MonitorSpec = section(MonitorSpec, "TensorBoard, CSV and wandb logging "
                                                "through DeepSpeed's monitor.")
    kernels: KernelsSpec = section(KernelsSpec, "dsforge's lean runtime kernels (stack "
                                                "dsforge), each auto/true/false.")




class LauncherKind(Kind):
    """A launcher: a built-in one or a plugin's launch target (plugins are read only for other names)."""

    expected = "a launcher name"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str)

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if isinstance(value, str) and value in BUILTIN_LAUNCHERS:
            return value
        names = list(BUILTIN_LAUNCHERS)
        if isinstance(value, str):
            plugins = launch_target_names()  # read only for a name dsforge does not ship: start-up stays lean
            if value in plugins:
                return value
            names += plugins
        # Reported as a choice, so a misspelt launcher gets the same "did you mean" as any other choice.
        issues.append(Issue(path, "choice", "", value, tuple(names)))
        return BAD

    def schema(self, defs: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [{"enum": list(BUILTIN_LAUNCHERS)},
                          {"type": "string", "description": "a launch target of an installed plugin"}]}


class RewriteRule(Section):
    """One module-rewrite rule: modules whose name matches become this parallel variant."""

    match: str = field(Str(), description="Regular expression over qualified module names.")
    as_: Literal["column", "row", "vocab", "norm", "replicate", "expert"] = field(
        Choice("column", "row", "vocab", "norm", "replicate", "expert"), alias="as",
        description="Parallel variant of the matched modules.")
    fused: int = field(Int(ge=1, le=MAX_HEADS), 1, "The weight fuses this many equal "
                                                   "blocks (3 for a fused QKV).")


class LaunchSpec(Section):
    """How the compiled job is started: the launcher and its settings."""

    launcher: str = field(
        LauncherKind(), "local", "How the job is started (accelerate: `accelerate launch` with "
                                 "accelerate_config.yaml; any other name: "
                                 "the launch target of an installed plugin).")
    master_addr: str = field(Str(), "127.0.0.1", "Rendezvous host (multi-node).")
    master_port: int = field(Int(ge=1, le=65535), 29500, "Rendezvous port.")
    image: str | None = field(Optional(Str()), None, "Container image (kubernetes).")
    namespace: str = field(Str(), "default", "Kubernetes namespace.")
    partition: str | None = field(Optional(Str()), None, "SLURM partition.")
    account: str | None = field(Optional(Str()), None, "SLURM account.")
    time_limit: str | None = field(Optional(Str()), None, "SLURM time limit, e.g. 24:00:00.")
    python: str | None = field(
        Optional(Str()), None, "Python interpreter the launcher runs on the nodes; default: the one that ran "
                               "`dsforge compile` (its absolute path, recorded in "
                               "plan.json); kubernetes: `python` in the image.")
    env: dict[str, str] = field(MappingOf(Str()), description="Environment variables for every rank.",
                                factory=dict)
    hosts: list[str] = field(
        ListOf(Str(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")), factory=list,
        description="Host names of the nodes, one per node (deepspeed launcher's hostfile); default for one "
                    "node: localhost.")
    rdzv_backend: Literal["c10d", "static"] = field(
        Choice("c10d", "static"), "c10d", "torchrun rendezvous across nodes: c10d (any node may start first) "
                                          "or static (each node needs NODE_RANK).")
    gpu_resource: str = field(
        Str(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"), "nvidia.com/gpu",
        "Kubernetes extended-resource name of one accelerator, requested gpus_per_node times per pod.")


class SearchSpec(Section):
    """The layout search for the `auto` fields: what it optimises, the limits it keeps, how many it shows."""

    objective: Literal["throughput", "time_to_train", "cost", "min_gpus"] = field(
        Choice("throughput", "time_to_train", "cost", "min_gpus"), "throughput",
        "throughput: most tokens/s; time_to_train: least time for `tokens`; cost: least money for `tokens` "
        "at `price_per_gpu_hour`; min_gpus: the fewest GPUs that train `tokens` within `deadline_hours`.")
    tokens: float | None = field(Optional(Float(ge=1, le=1e30)), None,
                                 "Token budget of time_to_train, cost and min_gpus; default: training.steps "
                                 "x tokens per step.")
    # a GPU-hour costs ~1-10 US$ in 2024 clouds; the bound only keeps products finite
    price_per_gpu_hour: float | None = field(Optional(Float(gt=0, le=1e9)), None,
                                             "Price of one GPU for one hour (objective cost).")
    deadline_hours: float | None = field(Optional(Float(gt=0, le=1e9)), None,
                                         "Wall time the token budget must train within (objective min_gpus).")
    max_tp: int | None = field(Optional(Int(ge=1, le=MAX_WORLD)), None,
                               "Largest tensor-parallel degree to consider; "
                               "default: gpus_per_node (TP inside a node).")
    memory_fraction: float = field(Float(gt=0, le=1), 0.9,
                                   "A candidate's busiest rank may use at most "
                                   "this share of the accelerator memory.")
    global_batch: tuple[int, int] | None = field(
        Optional(TupleOf(Int(ge=1, le=MAX_BATCH), Int(ge=1, le=MAX_BATCH))), None,
        "[min, max] sequences per step to choose from (powers "
        "of two and both ends); default: training.global_batch.")
    max_nodes: int = field(Int(ge=1, le=MAX_WORLD), 1024, "Most nodes `hardware.nodes: auto` may choose.")
    top: int = field(Int(ge=1, le=1000), 5, "Candidates `dsforge search` shows.")


class JobSpec(Section):
    """A whole job file (format version 1)."""

    version: Literal[1] = field(Choice(1), description="Job-file format version.")
    name: str = field(Str(min_length=1), "job", "Job name (used in file and queue names).")
    stack: Literal["dsforge", "megatron-te", "megatron-deepspeed"] = field(
        Choice("dsforge", "megatron-te", "megatron-deepspeed"), "dsforge",
        "What runs the job: dsforge (its runtime, the default), megatron-te (Megatron-Core with Transformer "
        "Engine) or megatron-deepspeed (DeepSpeed's Megatron fork: its fused kernels on DeepSpeed's engine); "
        "memory, FLOPs and time follow its kernels.")
    model: ModelSpec = field(Nested(ModelSpec), description="The model to train.")
    hardware: HardwareSpec = field(Nested(HardwareSpec), description="The machines it runs on.")
    parallel: ParallelSpec = section(ParallelSpec, "The parallel layout.")
    training: TrainingSpec = section(TrainingSpec, "Batch sizes, precision, optimizer, "
                                                   "schedule, data, checkpoints.")
    rewrite: list[RewriteRule] = field(
        ListOf(Nested(RewriteRule)), description="Extra rewrite rules (custom models).", factory=list)
    deepspeed: dict[str, Any] = field(MappingOf(), description=(
        "Raw ds_config overrides, merged last and checked against DeepSpeed 0.19.8: they may restate, never "
        "change, what the job states elsewhere (DSF508, DSF520, DSF525, DSF527); sections dsforge does not "
        "model are refused (DSF528)."), factory=dict)
    launch: LaunchSpec = section(LaunchSpec, "How the compiled job is started.")
    search: SearchSpec | None = field(Optional(Nested(SearchSpec)), None,
                                      "The layout search for `auto` fields "
                                      "(`dsforge search`); absent: its defaults.")
