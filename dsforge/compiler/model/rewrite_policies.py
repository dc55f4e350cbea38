"""Rewrite policies as plain data: which module of which model family becomes which parallel variant.

One table per architecture, rows of (module-name regex, variant, options), in the shape of
picotron's tensor-parallel plan (picotron/tensor_parallel/tensor_parallel.py) and DeepSpeed
AutoTP's presets (deepspeed/module_inject/autotp_config.py). User `rewrite:` rules have the same
shape and come first; `arch: custom` uses only them. A regex must match the *whole* qualified module
name (``re.fullmatch``); the first matching row wins and claims the module's whole subtree.
The runtime (dsforge.runtime.rewrite) applies these rows to a real module tree; the compiler only
prints them, so this file must never import torch.

Variants (Shoeybi et al. 2019, Megatron-LM sec. 3; Korthikanti et al. 2022 for sequence parallelism):
  column     weight split along its output features (Linear dim 0, HF Conv1D dim 1); bias split too
  row        weight split along its input features (Linear dim 1, HF Conv1D dim 0); bias kept whole
  vocab      embedding table or LM head split along the vocabulary (dim 0)
  norm       replicated; under sequence parallelism its gradients are summed over the TP group
  head_norm  a norm over one head's channels (Qwen3's q_norm/k_norm): replicated, but each TP rank
             applies it to its own heads only, so its gradient is summed over the TP group
  shard_norm a norm over a whole head-split projection (OLMo2's q_norm/k_norm): its weight split by
             heads like the projection, its mean square all-reduced over the TP group
  replicate  every parameter of the subtree kept whole on every rank
  expert     experts split over the expert-parallel group (E / ep experts per rank); the MoE block's
             shared expert (Qwen2-MoE, DeepSeek) is a dense MLP placed by its own column/row rows
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dsforge import extensions

if TYPE_CHECKING:
    from dsforge.compiler.spec.schema import RewriteRule

Variant = Literal["column", "row", "vocab", "norm", "head_norm", "shard_norm", "scalars", "replicate",
                  "expert"]
#: How a head-split weight is laid out: query heads, key/value heads, or per-head [q | k | v] (GPT-NeoX).
HeadKind = Literal["q", "kv", "qkv"]

# Optional prefix so a table fits both the causal-LM wrapper (`model.layers.0...`) and the bare
# decoder a factory may return (`layers.0...`).
_P = r"(?:.+\.)?"


@dataclass(frozen=True)
class PolicyRow:
    """One rule: modules whose qualified name fully matches ``match`` become ``variant``.

    ``fused``: the output features are this many equal blocks, each split on its own (3 for a
    fused QKV). ``heads``: the split runs along attention heads — "q" (query heads), "kv"
    (key/value heads, GQA) or "qkv" (each head's q, k and v side by side, GPT-NeoX) — so the plan
    checks that whole heads land on each rank. ``blocks``: a fused weight of unequal blocks, each
    named by its head kind (Phi3's qkv_proj under GQA: ("q", "kv", "kv")), each split by its real size.
    """

    match: str
    variant: Variant
    fused: int = 1
    heads: HeadKind | None = None
    why: str = ""
    blocks: tuple[Literal["q", "kv"], ...] = ()


@dataclass(frozen=True)
class AttrScale:
    """An attribute of matched modules that holds a global width and must become the local one (÷ tp)."""

    match: str
    attr: str


@dataclass(frozen=True)
class Policy:
    """The rewrite policy of one model family.

    ``layers``: regex of a decoder layer's name with the layer index as group 1 (pipeline stages
    cut here). ``signature``: regexes that must each match some module for `arch: auto` to pick
    this family. ``attr_scales``: attributes the family's forward reads that hold global widths
    (``config.x``: an attribute of the module's config, which the module then gets a copy of).
    ``absent``: regexes no module may match (what tells two families with the same names apart).
    ``sequence_parallel``: the sequence-parallel regions (dsforge.runtime.rewrite.sequence) were
    checked against this family's forward; other families refuse sequence_parallel.
    """

    arch: str
    rows: tuple[PolicyRow, ...]
    layers: str
    signature: tuple[str, ...]
    attr_scales: tuple[AttrScale, ...] = ()
    absent: tuple[str, ...] = ()
    sequence_parallel: bool = False


GPT2 = Policy(
    arch="gpt2",
    rows=(
        PolicyRow(_P + r"wte", "vocab", why="token embedding split over the vocabulary"),
        PolicyRow(_P + r"wpe", "replicate", why="position table is small and read by every rank"),
        PolicyRow(_P + r"h\.\d+\.ln_[12]", "norm"),
        PolicyRow(_P + r"h\.\d+\.attn\.c_attn", "column", fused=3, heads="q",
                  why="fused QKV (HF Conv1D, weight stored in x out): each of q, k, v split by heads"),
        PolicyRow(_P + r"h\.\d+\.attn\.c_proj", "row", heads="q"),
        PolicyRow(_P + r"h\.\d+\.mlp\.c_fc", "column"),
        PolicyRow(_P + r"h\.\d+\.mlp\.c_proj", "row"),
        PolicyRow(_P + r"ln_f", "norm"),
        PolicyRow(r"lm_head", "vocab", why="LM head split over the vocabulary (tied to wte when tied)"),
    ),
    layers=_P + r"h\.(\d+)",
    signature=(_P + r"wte", _P + r"wpe", _P + r"h\.\d+\.attn\.c_attn", _P + r"h\.\d+\.mlp\.c_fc"),
    attr_scales=(AttrScale(_P + r"h\.\d+\.attn", "split_size"), AttrScale(_P + r"h\.\d+\.attn", "num_heads")),
    sequence_parallel=True,
)

_LLAMA_ATTENTION = (
    PolicyRow(_P + r"embed_tokens", "vocab"),
    PolicyRow(_P + r"layers\.\d+\.self_attn\.q_proj", "column", heads="q"),
    PolicyRow(_P + r"layers\.\d+\.self_attn\.[kv]_proj", "column", heads="kv",
              why="GQA: whole key/value heads per rank"),
    PolicyRow(_P + r"layers\.\d+\.self_attn\.o_proj", "row", heads="q"),
    PolicyRow(_P + r"layers\.\d+\.(?:input|post_attention)_layernorm", "norm"),
)
_LLAMA_TAIL = (
    PolicyRow(_P + r"norm", "norm"),
    PolicyRow(r"lm_head", "vocab"),
)

LLAMA = Policy(
    arch="llama",
    rows=_LLAMA_ATTENTION + (
        PolicyRow(_P + r"layers\.\d+\.mlp\.(?:gate|up)_proj", "column"),
        PolicyRow(_P + r"layers\.\d+\.mlp\.down_proj", "row"),
    ) + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_proj",
               _P + r"layers\.\d+\.mlp\.gate_proj"),
    sequence_parallel=True,
)

MIXTRAL = Policy(
    arch="mixtral",
    rows=_LLAMA_ATTENTION + (
        PolicyRow(_P + r"layers\.\d+\.(?:mlp|block_sparse_moe)\.gate", "replicate",
                  why="router: every rank scores every token"),
        PolicyRow(_P + r"layers\.\d+\.(?:mlp|block_sparse_moe)\.experts", "expert",
                  why="experts split over the expert-parallel group"),
    ) + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_proj",
               _P + r"layers\.\d+\.(?:mlp|block_sparse_moe)\.experts"),
    absent=(_P + r"layers\.\d+\.mlp\.shared_experts?",),
    sequence_parallel=True,
)

_QK_HEAD_NORMS = (
    PolicyRow(_P + r"layers\.\d+\.self_attn\.[qk]_norm", "head_norm",
              why="per-head q/k norm: each rank normalises its own heads, so its gradient is summed over TP"),
)
_DENSE_MLP = (
    PolicyRow(_P + r"layers\.\d+\.mlp\.(?:gate|up)_proj", "column"),
    PolicyRow(_P + r"layers\.\d+\.mlp\.down_proj", "row"),
)
_ROUTED = (
    PolicyRow(_P + r"layers\.\d+\.mlp\.gate", "replicate", why="router: every rank scores every token"),
    PolicyRow(_P + r"layers\.\d+\.mlp\.experts", "expert",
              why="experts split over the expert-parallel group"),
)
_SHARED = (
    PolicyRow(_P + r"layers\.\d+\.mlp\.shared_experts?\.(?:gate|up)_proj", "column",
              why="shared expert: a dense MLP beside the routed experts"),
    PolicyRow(_P + r"layers\.\d+\.mlp\.shared_experts?\.down_proj", "row"),
    PolicyRow(_P + r"layers\.\d+\.mlp\.shared_expert_gate", "replicate",
              why="the shared expert's sigmoid gate reads the whole hidden state"),
)
_GEMMA_NORMS = (
    PolicyRow(_P + r"layers\.\d+\.(?:pre|post)_feedforward_layernorm", "norm"),
)

QWEN3 = Policy(
    arch="qwen3",
    rows=_LLAMA_ATTENTION + _QK_HEAD_NORMS + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_norm",
               _P + r"layers\.\d+\.mlp\.gate_proj"),
    absent=(_P + r"layers\.\d+\.(?:pre|post)_feedforward_layernorm",),
)

GEMMA2 = Policy(
    arch="gemma2",
    rows=_LLAMA_ATTENTION + _GEMMA_NORMS + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.pre_feedforward_layernorm"),
    absent=(_P + r"layers\.\d+\.self_attn\.q_norm",),
)

GEMMA3 = Policy(
    arch="gemma3",
    rows=_LLAMA_ATTENTION + _QK_HEAD_NORMS + _GEMMA_NORMS + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.pre_feedforward_layernorm",
               _P + r"layers\.\d+\.self_attn\.q_norm"),
)

OLMO2 = Policy(
    arch="olmo2",
    rows=_LLAMA_ATTENTION + (
        PolicyRow(_P + r"layers\.\d+\.self_attn\.q_norm", "shard_norm", heads="q",
                  why="norm over all query heads: weight split by heads, mean square summed over TP"),
        PolicyRow(_P + r"layers\.\d+\.self_attn\.k_norm", "shard_norm", heads="kv",
                  why="norm over all key heads: weight split by heads, mean square summed over TP"),
        PolicyRow(_P + r"layers\.\d+\.post_feedforward_layernorm", "norm"),
    ) + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_norm",
               _P + r"layers\.\d+\.post_feedforward_layernorm"),
    absent=(_P + r"layers\.\d+\.(?:input|pre_feedforward)_layernorm",),
)

PHI3 = Policy(
    arch="phi3",
    rows=(
        PolicyRow(_P + r"embed_tokens", "vocab"),
        PolicyRow(_P + r"layers\.\d+\.self_attn\.qkv_proj", "column", blocks=("q", "kv", "kv"),
                  why="fused QKV of unequal blocks under GQA: q, k and v each split by their own heads"),
        PolicyRow(_P + r"layers\.\d+\.self_attn\.o_proj", "row", heads="q"),
        PolicyRow(_P + r"layers\.\d+\.mlp\.gate_up_proj", "column", fused=2,
                  why="fused gate and up projections"),
        PolicyRow(_P + r"layers\.\d+\.mlp\.down_proj", "row"),
        PolicyRow(_P + r"layers\.\d+\.(?:input|post_attention)_layernorm", "norm"),
    ) + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.qkv_proj",
               _P + r"layers\.\d+\.mlp\.gate_up_proj"),
    # Phi3Attention slices its fused output at config.num_attention_heads x head_dim.
    attr_scales=(AttrScale(_P + r"layers\.\d+\.self_attn", "num_key_value_heads"),
                 AttrScale(_P + r"layers\.\d+\.self_attn", "config.num_attention_heads"),
                 AttrScale(_P + r"layers\.\d+\.self_attn", "config.num_key_value_heads")),
)

GPT_NEOX = Policy(
    arch="gpt_neox",
    rows=(
        PolicyRow(_P + r"embed_in", "vocab"),
        PolicyRow(_P + r"layers\.\d+\.attention\.query_key_value", "column", heads="qkv",
                  why="fused QKV laid out head by head ([q k v] per head): split into whole heads"),
        PolicyRow(_P + r"layers\.\d+\.attention\.dense", "row", heads="q"),
        PolicyRow(_P + r"layers\.\d+\.mlp\.dense_h_to_4h", "column"),
        PolicyRow(_P + r"layers\.\d+\.mlp\.dense_4h_to_h", "row"),
        PolicyRow(_P + r"layers\.\d+\.(?:input|post_attention)_layernorm", "norm"),
        PolicyRow(_P + r"final_layer_norm", "norm"),
        PolicyRow(r"(?:embed_out|lm_head)", "vocab"),
    ),
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_in", _P + r"layers\.\d+\.attention\.query_key_value"),
)

QWEN2_MOE = Policy(
    arch="qwen2_moe",
    rows=_LLAMA_ATTENTION + _ROUTED + _SHARED + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.mlp\.experts",
               _P + r"layers\.\d+\.mlp\.shared_expert_gate"),
)

QWEN3_MOE = Policy(
    arch="qwen3_moe",
    rows=_LLAMA_ATTENTION + _QK_HEAD_NORMS + _ROUTED + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_norm",
               _P + r"layers\.\d+\.mlp\.experts"),
    absent=(_P + r"layers\.\d+\.mlp\.shared_experts?",),
)

DEEPSEEK_V3 = Policy(
    arch="deepseek_v3",
    rows=(
        PolicyRow(_P + r"embed_tokens", "vocab"),
        # MLA's low-rank projections and the rotary key shared by every head have no exact per-head split
        # through HF's forward; replicated, every rank computes the whole attention (exact, no memory saved).
        PolicyRow(_P + r"layers\.\d+\.self_attn", "replicate",
                  why="MLA attention replicated on every TP rank: exact, its memory is not divided"),
        PolicyRow(_P + r"layers\.\d+\.(?:input|post_attention)_layernorm", "norm"),
    ) + _ROUTED + _SHARED + _DENSE_MLP + _LLAMA_TAIL,
    layers=_P + r"layers\.(\d+)",
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.kv_a_proj_with_mqa"),
)

POLICIES: dict[str,
               Policy] = {p.arch: p for p in (GPT2, LLAMA, MIXTRAL, QWEN3, GEMMA2, GEMMA3, OLMO2, PHI3,
                                              GPT_NEOX,
                                                  QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3)}

#: The order `arch: auto` tries the families in: the most specific signature first, plugin families last
#: (installing a plugin never changes how a model a built-in family recognises is rewritten).
DETECT_ORDER: list[str] = ["deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma3", "gemma2", "olmo2",
                           "qwen3", "phi3", "gpt_neox", "llama", "gpt2"]

#: The built-in families and the HF model types they were tested on (README "Supported model families").
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral", "qwen2"), "mixtral": ("mixtral",), "gpt2": ("gpt2",), "qwen3": ("qwen3",),
    "gemma2": ("gemma2",), "gemma3": ("gemma3_text",), "olmo2": ("olmo2",), "phi3": ("phi3",),
    "gpt_neox": ("gpt_neox",), "qwen2_moe": ("qwen2_moe",), "qwen3_moe": ("qwen3_moe",),
    "deepseek_v3": ("deepseek_v3",),
}


def register_policy(policy: Policy) -> None:
    """Add the policy of a model family dsforge does not ship (plugins); `arch: auto` can then detect it."""
    if policy.arch in POLICIES:
        raise ValueError(f"a rewrite policy for arch {policy.arch!r} is already registered")
    POLICIES[policy.arch] = policy
    DETECT_ORDER.append(policy.arch)


def load_plugins() -> None:
    """Register the policies of installed plugins (entry points `dsforge.rewrite_policies`), once."""
    extensions.ensure_loaded("policies")


def _load_plugin_policies(entry: extensions.PluginEntry, load: Callable[[], Any]) -> list[str]:
    """The `dsforge.rewrite_policies` loader: a plugin adds model families, never replaces one."""
    items = extensions.items_of(load(), Policy)
    for p in items:
        if p.arch in POLICIES:
            raise extensions.PluginLoadError(f"a rewrite policy for arch {p.arch!r} already exists")
    for p in items:
        register_policy(p)
    return [f"rewrite policy {p.arch}" for p in items]


extensions.register_loader("policies", _load_plugin_policies)


def user_rows(rules: Sequence[RewriteRule]) -> tuple[PolicyRow, ...]:
    """The job file's `rewrite:` rules as policy rows."""
    return tuple(PolicyRow(r.match, r.as_, fused=r.fused, why="job file `rewrite:`") for r in rules)


def rows_for(arch: str, rules: Sequence[RewriteRule]) -> list[tuple[str, PolicyRow]]:
    """The rows that apply to a job, each with its source label; user rules first, built-ins after."""
    load_plugins()
    out = [(f"rewrite[{i}]", row) for i, row in enumerate(user_rows(rules))]
    policy = POLICIES.get(arch)
    if policy is not None:
        out += [(f"{arch}[{i}]", row) for i, row in enumerate(policy.rows)]
    return out


def format_description(desc: dict[str, Any]) -> list[str]:
    """Lines for `dsforge explain` from ``dsforge.runtime.rewrite.describe`` output (or plan.json's copy)."""
    if not desc.get("ok"):
        return [f"rewrite plan ({desc.get('arch')}): cannot place the model"] + [
            f"  {e}" for e in desc["errors"]
        ]
    head = (f"rewrite plan ({desc['arch']}, tp={desc['tp']}, ep={desc['ep']}"
            f"{', sequence-parallel' if desc['sequence_parallel'] else ''}):")
    lines = [head]
    for row in desc["summary"]:
        shards = ", ".join(f"{name} {'x'.join(map(str, p['shape']))} -> {'x'.join(map(str, p['shard']))}"
                           for name, p in row["params"].items())
        tied = f" (tied to {row['tied_to']})" if row.get("tied_to") else ""
        lines.append(f"  {row['variant']:<9} {row['modules']}{tied}: {shards}")
    params = desc["params"]
    lines.append(f"  parameters: {params['total']:,} exact; per rank by pipeline stage: "
                 + ", ".join(f"{n:,}" for n in params["per_rank_by_stage"]))
    lines += [f"  warning: {w}" for w in desc.get("warnings", [])]
    return lines
