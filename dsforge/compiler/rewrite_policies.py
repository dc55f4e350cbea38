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
  replicate  every parameter of the subtree kept whole on every rank
  expert     experts split over the expert-parallel group (E / ep experts per rank)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dsforge import extensions

if TYPE_CHECKING:
    from dsforge.compiler.schema import RewriteRule

Variant = Literal["column", "row", "vocab", "norm", "replicate", "expert"]

# Optional prefix so a table fits both the causal-LM wrapper (`model.layers.0...`) and the bare
# decoder a factory may return (`layers.0...`).
_P = r"(?:.+\.)?"


@dataclass(frozen=True)
class PolicyRow:
    """One rule: modules whose qualified name fully matches ``match`` become ``variant``.

    ``fused``: the output features are this many equal blocks, each split on its own (3 for a
    fused QKV). ``heads``: the split runs along attention heads — "q" (query heads) or "kv"
    (key/value heads, GQA) — so the plan checks that whole heads land on each rank.
    """

    match: str
    variant: Variant
    fused: int = 1
    heads: Literal["q", "kv"] | None = None
    why: str = ""


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
    this family. ``attr_scales``: attributes the family's forward reads that hold global widths.
    """

    arch: str
    rows: tuple[PolicyRow, ...]
    layers: str
    signature: tuple[str, ...]
    attr_scales: tuple[AttrScale, ...] = ()


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
    signature=(_P + r"embed_tokens", _P + r"layers\.\d+\.self_attn\.q_proj", _P + r"layers\.\d+\.mlp\.gate_proj"),
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
)

POLICIES: dict[str, Policy] = {p.arch: p for p in (GPT2, LLAMA, MIXTRAL)}

#: The order `arch: auto` tries the families in: the most specific signature first, plugin families last
#: (installing a plugin never changes how a model a built-in family recognises is rewritten).
DETECT_ORDER: list[str] = ["mixtral", "llama", "gpt2"]


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
        return [f"rewrite plan ({desc.get('arch')}): cannot place the model"] + [f"  {e}" for e in desc["errors"]]
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
