"""Building only what a rank owns: the model's parameters on the meta device, then this rank's slices made
real.

The dense model is constructed with every parameter on ``meta`` (buffers such as RoPE's
frequencies stay real: they are computed, not learned) and rewritten there, so no rank ever
allocates a tensor it does not keep. Then each parameter of this rank's pipeline stage gets its
values: the slice the rewrite plan assigns to this rank (``ParamShard.dim`` and the variant's cut,
the same cut ``from_dense`` makes) of either

* a seeded initialisation that is a pure function of the job's seed, the parameter's index in the
  dense model and the position inside it (``chunked_init``: the tensor is drawn in fixed chunks of
  rows, each from its own generator), so a slice is computed without the rest and equals the same
  slice of the dense model a single process builds with ``build_model(..., "cpu")``; or
* the tensors of a pretrained checkpoint, read slice by slice (dsforge.runtime.pretrained).

Values are cast to the job's precision as they are placed; DeepSpeed keeps its fp32 master copy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dsforge.runtime.errors import ModelBuildError
from dsforge.runtime.layers.sharding import block_widths, gathered_order, split_sizes
from dsforge.runtime.rewrite.planner import ModulePlan, RewritePlan
from dsforge.runtime.rewrite.shard import ParamShard
from dsforge.runtime.weights_io import SliceTag, tag

CHUNK_ELEMENTS = 1 << 22  # elements drawn from one generator: 16 MB of fp32, the most a slice holds extra
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Ranges = list[tuple[int, int]]


class MaterializeError(ModelBuildError):
    """A parameter of this rank could not be given its values (no source, or a shape that does not fit)."""


class WeightRangeError(MaterializeError):
    """A weight is not finite in the job's dtype: an fp16 cast overflowed (or the checkpoint holds
    inf/NaN)."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers lands on the meta device; buffers stay where they are made.

    ``torch.device("meta")`` would also put computed buffers (RoPE's ``inv_freq``) on meta, where
    their values are lost; parameters already on meta are kept as they are so that ties survive.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class InitSpec:
    """How one dense parameter is initialised: its index in the dense model and its distribution."""

    index: int
    fill: str  # normal | ones | zeros
    std: float = 0.0


def init_specs(model: nn.Module, std: float, scaled: Iterable[str] = (), scaled_std: float | None = None
               ) -> dict[str, InitSpec]:
    """The initialisation of every parameter of a dense model, by qualified name (HF's scheme).

    Linear, embedding and expert weights N(0, std) (``scaled`` name suffixes: ``scaled_std``, GPT-2's
    residual projections), norm weights 1, biases 0. The index is the parameter's position in
    ``named_parameters()``, which the dense model fixes whatever the layout.
    """
    kinds: dict[int, tuple[str, float]] = {}
    suffixes = tuple(scaled)
    for mname, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if pname == "bias":
                kinds.setdefault(id(p), ("zeros", 0.0))
            elif is_norm:
                kinds.setdefault(id(p), ("ones", 0.0))
            elif suffixes and full.endswith(suffixes) and scaled_std is not None:
                kinds.setdefault(id(p), ("normal", scaled_std))
            else:
                kinds.setdefault(id(p), ("normal", std))
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        fill, s = kinds[id(p)]
        out[name] = InitSpec(i, fill, s)
    return out


def _chunk_seed(seed: int, index: int, chunk: int) -> int:
    # An odd-multiplier mix (splitmix-style) so nearby (seed, index, chunk) triples give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + chunk * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


def chunked_init(seed: int, spec: InitSpec, shape: tuple[int, ...], dim: int | None = None,
                 ranges: Ranges | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``spec``'s values for the parameter of ``shape`` in ``dtype``, whole or only ``ranges`` along ``dim``.

    Rows (dimension 0) are drawn in fp32 in chunks of about CHUNK_ELEMENTS elements, chunk ``c`` from a
    generator seeded by (seed, index, c); a slice draws only the chunks it overlaps (all of them,
    one at a time, for a cut along another dimension), so it equals that slice of the whole tensor.
    Each chunk is cast into the result as it is drawn: the result plus one fp32 chunk is all it holds.
    """
    if not shape:
        shape = ()
    if spec.fill != "normal" or not shape:
        full_shape = list(shape)
        if dim is not None and ranges is not None:
            full_shape[dim] = sum(n for _, n in ranges)
        if spec.fill == "normal":  # a 0-d parameter
            g = torch.Generator().manual_seed(_chunk_seed(seed, spec.index, 0))
            return torch.empty(full_shape).normal_(0.0, spec.std, generator=g).to(dtype)
        return (torch.ones if spec.fill == "ones" else torch.zeros)(full_shape, dtype=dtype)
    rows, per_row = shape[0], math.prod(shape[1:])
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))

    def chunk(c: int) -> Tensor:  # valid until the next call: every caller copies out of it at once
        n = min(step, rows - c * step)
        g = torch.Generator().manual_seed(_chunk_seed(seed, spec.index, c))
        return _scratch(n * per_row).view(n, *shape[1:]).normal_(0.0, spec.std, generator=g)

    if dim is None or ranges is None:
        out = torch.empty(shape, dtype=dtype)
        for c in range(-(-rows // step)):
            out[c * step:(c + 1) * step].copy_(chunk(c))
        return out
    if dim == 0:
        out = torch.empty((sum(n for _, n in ranges), *shape[1:]), dtype=dtype)
        at = 0
        for start, length in ranges:
            for c in range(start // step, (start + length - 1) // step + 1):
                lo, hi = max(start, c * step) - c * step, min(start + length, (c + 1) * step) - c * step
                out[at:at + hi - lo].copy_(chunk(c)[lo:hi])
                at += hi - lo
        return out
    sliced = list(shape)
    sliced[dim] = sum(n for _, n in ranges)
    out = torch.empty(sliced, dtype=dtype)
    for c in range(-(-rows // step)):
        block, rows_here = chunk(c), out[c * step:(c + 1) * step]
        at = 0
        for s0, n in ranges:
            rows_here.narrow(dim, at, n).copy_(block.narrow(dim, s0, n))
            at += n
    return out


#: The fp32 buffer chunks are drawn into, reused from one chunk to the next: a fresh 16 MB tensor per chunk,
#: freed at once, raises glibc's mmap threshold and leaves the heap fragmented (a tp2 rank of the 1B
#: Llama kept about 2x its shard resident); ``materialize`` releases it when the fill is done.
_SCRATCH: list[Tensor] = []


def _scratch(numel: int) -> Tensor:
    if not _SCRATCH or _SCRATCH[0].numel() < numel:
        _SCRATCH[:] = [torch.empty(max(numel, min(CHUNK_ELEMENTS, 1 << 22)))]
    return _SCRATCH[0][:numel]


class WeightSource(Protocol):
    """Where parameter values come from: a seeded initialisation or a checkpoint."""

    def values(self, name: str, shape: tuple[int, ...], dim: int | None, ranges: Ranges | None,
               dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense parameter ``name`` of ``shape``, whole or its ``ranges`` along ``dim`` (``dtype``: the
        dtype wanted, which a source may produce directly; the caller converts whatever comes)."""
        ...


@dataclass
class SeededInit:
    """Values drawn by ``chunked_init`` from the job's seed."""

    seed: int
    specs: dict[str, InitSpec]

    def values(self, name: str, shape: tuple[int, ...], dim: int | None, ranges: Ranges | None,
               dtype: torch.dtype = torch.float32) -> Tensor:
        """This parameter's seeded values (or slice), drawn in fp32 and cast to ``dtype`` chunk by chunk."""
        spec = self.specs.get(name)
        if spec is None:
            raise MaterializeError(f"{name}: not a parameter of the dense "
                                   f"model the initialisation was planned on")
        return chunked_init(self.seed, spec, shape, dim, ranges, dtype)


@dataclass
class PretrainedWeights:
    """Values read from an HF checkpoint (``prefix``: the base model's, which hub checkpoints may omit)."""

    reader: Any  # dsforge.runtime.pretrained.CheckpointReader
    prefix: str = ""

    def values(self, name: str, shape: tuple[int, ...], dim: int | None, ranges: Ranges | None,
               dtype: torch.dtype = torch.float32) -> Tensor:
        """This parameter's slice of the checkpoint's tensor in its stored dtype (the caller converts it, and
        the reader counts what was stored); an error when it is missing or shaped otherwise."""
        from dsforge.runtime.pretrained import PretrainedLoadError

        key = self.reader.resolve(name, self.prefix)
        if key is None:
            converted = self.reader.unconverted(name)
            raise PretrainedLoadError(f"DSF640: {self.reader.directory} holds no tensor for the model's "
                                      f"parameter {name}; "
                                      + (converted or "the checkpoint was written for another model"))
        stored = self.reader.shape(key)
        if stored != tuple(shape):
            raise PretrainedLoadError(f"DSF640: {self.reader.directory}: tensor {key} is {list(stored)}, the "
                                      f"model's parameter {name} is {list(shape)}")
        return self.reader.read(key, dim, ranges or ())


@dataclass
class Target:
    """One parameter of the rewritten model and the slice of a dense parameter it holds."""

    module: nn.Module
    attr: str
    dense: str
    shape: tuple[int, ...]  # the dense parameter's full shape (storage layout)
    dim: int | None = None
    ranges: Ranges | None = None
    transpose: bool = False  # HF Conv1D stores (in, out); the parallel layers hold (out, in)


def owned_ranges(entry: ModulePlan, p: ParamShard, tp_rank: int, tp: int) -> Ranges | None:
    """This TP rank's ranges along ``p.dim`` of a planned parameter: the cut ``from_dense`` makes, per
    variant.

    A column cut takes the rank's share of every fused block (q, k, v), a row cut one contiguous
    share, a vocab cut the rows ``split_sizes`` gives the rank. None: the parameter is whole here.
    """
    if p.dim is None:
        return None
    n = p.shape[p.dim]
    if entry.variant == "column":
        out, offset = [], 0
        widths = list(getattr(entry, "widths", ()) or ()) or block_widths(n, entry.fused)
        for w in widths:
            share = w // tp
            out.append((offset + tp_rank * share, share))
            offset += w
        return out
    if entry.variant == "vocab":
        sizes = split_sizes(n, tp)
        return [(sum(sizes[:tp_rank]), sizes[tp_rank])]
    if entry.variant in ("row", "shard_norm"):  # one contiguous share (a sharded norm: whole heads)
        return [(tp_rank * (n // tp), n // tp)]
    raise MaterializeError(f"{entry.name}.{p.name}: variant {entry.variant} cut along dim {p.dim} has no "
                           "slice rule here")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


#: Modules the sequence-parallel rewrite (dsforge.runtime.rewrite.sequence) wraps a block in; the wrapped
#: module is their first child, so a dense module name is found by looking through them.
WRAPPERS = ("SequenceRegion", "SequenceEntry", "SequenceExit")


def _unwrap(module: nn.Module) -> nn.Module:
    while type(module).__name__ in WRAPPERS and module._modules:
        module = next(iter(module._modules.values()))
    return module


def submodule(root: nn.Module, name: str) -> nn.Module:
    """The module a dense model's qualified ``name`` denotes in the rewritten tree (through SP wrappers)."""
    module = _unwrap(root)
    for part in name.split(".") if name else []:
        child = module._modules.get(part)
        if child is None:
            raise AttributeError(f"{type(module).__name__} has no submodule {part!r} (looking for {name})")
        module = _unwrap(child)
    return module


def _param_slot(root: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    mod_name, _, attr = qualified.rpartition(".")
    return submodule(root, mod_name), attr


def rank_targets(model: nn.Module, rp: RewritePlan, tp_rank: int,
                 only: set[str] | None = None) -> list[Target]:
    """Every parameter this rank holds after the rewrite, with the dense slice it takes (``only``: these
    modules)."""
    targets: list[Target] = []
    moe_blocks: dict[str, nn.Module] = {}
    for entry in rp.modules:
        if only is not None and entry.name not in only:
            continue
        block = _replaced_block(model, entry.name)
        if block is not None:
            block_name, moe = block
            targets += _moe_targets(entry, block_name, moe, moe_blocks)
            continue
        module = submodule(model, entry.name)
        for p in entry.params:
            owner = entry.owners.get(p.name, _join(entry.name, p.name))
            holder, attr = _param_slot(module, p.name)
            # A rewritten HF Conv1D (weight stored in x out) holds (out, in); one left as it is (tp = 1) does
            # not.
            transpose = (entry.kind == "conv1d" and p.name == "weight" and entry.variant in ("column", "row")
                         and type(holder).__name__ != "Conv1D")
            targets.append(Target(holder, attr, owner, p.shape, p.dim, owned_ranges(entry, p, tp_rank, rp.tp),
                                  transpose))
    return targets


def _replaced_block(model: nn.Module, name: str) -> tuple[str, nn.Module] | None:
    """The expert-parallel MoE block that replaced ``name`` or one of its parents, if any."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        try:
            module = submodule(model, prefix)
        except AttributeError:
            continue
        if type(module).__name__ == "ExpertParallelMoE":
            return prefix, module
        if cut == len(parts):
            return None
    return None


def _moe_targets(entry: ModulePlan, block_name: str, moe: Any, seen: dict[str, nn.Module]) -> list[Target]:
    """An expert-parallel block's parameters: its router whole, each local expert's slice of the stacked
    experts."""
    out: list[Target] = []
    if entry.variant == "expert":
        shapes = {p.name: p.shape for p in entry.params}
        if set(shapes) != {"gate_up_proj", "down_proj"}:
            raise MaterializeError(f"{entry.name}: expert-parallel blocks are built from HF Mixtral's "
                                   f"stacked gate_up_proj/down_proj, not {sorted(shapes)}")
        for i, local in enumerate(moe.local_experts):
            e = moe.first_expert + i
            for attr_mod, key in ((local.gate_up, "gate_up_proj"), (local.down, "down_proj")):
                out.append(Target(attr_mod, "weight", _join(entry.name, key), shapes[key], 0, [(e, 1)]))
    elif entry.name == f"{block_name}.gate":
        wg = moe.moe.deepspeed_moe.gate.wg
        out.append(Target(wg, "weight", _join(entry.name, "weight"), tuple(entry.params[0].shape)))
    else:
        raise MaterializeError(f"{entry.name}: inside the expert-parallel block {block_name}, which holds "
                               f"only the router and the experts")
    seen[block_name] = moe
    return out


#: Called as ``fn(root, target, param)`` after each parameter is placed (see ``watch_fill``).
_WATCHERS: list[Callable[[nn.Module, Target, nn.Parameter], None]] = []


@contextlib.contextmanager
def watch_fill(fn: Callable[[nn.Module, Target, nn.Parameter], None]) -> Iterator[None]:
    """Inside: ``fn(root, target, param)`` runs after every parameter ``materialize`` places (and partitions).

    How the tests see the build as it happens: under ZeRO-3, that every parameter filled before this
    one already holds only its partition.
    """
    _WATCHERS.append(fn)
    try:
        yield
    finally:
        _WATCHERS.remove(fn)


def materialize(targets: list[Target], source: WeightSource, dtype: torch.dtype, root: nn.Module,
                place: Callable[[nn.Parameter], None] | None = None) -> int:
    """Give every target its values from ``source`` in ``dtype``; a parameter shared by several modules once.

    The new parameter replaces the meta one in every module of ``root`` that holds it (tied
    weights stay tied) and keeps its tags (tensor_model_parallel, sequence_parallel, DeepSpeed's
    MoE marks). ``place``, when given, takes each parameter as soon as it holds its values (ZeRO-3:
    keep this rank's partition, free the rest) and before the next is made, so at most one whole
    parameter exists at a time. Returns the elements materialised.
    """
    done: dict[int, nn.Parameter] = {}
    count = 0
    for t in targets:
        old = t.module._parameters.get(t.attr)
        if old is None:
            raise MaterializeError(f"{t.dense}: the rewritten module "
                                   f"{type(t.module).__name__} has no parameter {t.attr}")
        if id(old) in done:
            continue
        if old.device.type != "meta":  # already real (a module outside the rewrite kept its values)
            continue
        new = _filled(t, old, source, dtype)
        count += new.numel()
        if place is not None:
            place(new)
        done[id(old)] = new
        for watcher in tuple(_WATCHERS):
            watcher(root, t, new)
    _SCRATCH.clear()
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in done:
                module._parameters[name] = done[id(p)]
    _restore_buffers(root)
    return count


def _filled(t: Target, old: nn.Parameter, source: WeightSource, dtype: torch.dtype) -> nn.Parameter:
    """The real parameter that replaces ``old``, with ``t``'s values in ``dtype`` (its temporaries die
    here)."""
    value = source.values(t.dense, t.shape, t.dim, t.ranges, dtype)
    if t.transpose:
        value = value.t()
    if t.ranges is not None and t.dim == 0 and len(t.shape) == len(old.shape) + 1:
        value = value.reshape(old.shape)  # one expert out of the stacked experts
    if tuple(value.shape) != tuple(old.shape):
        raise MaterializeError(f"{t.dense}: the planned slice is {list(value.shape)} but this rank's "
                               f"parameter is {list(old.shape)}")
    value = value.to(dtype).contiguous()
    _check_finite(t.dense, value)
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    # Tensor hooks live outside __dict__: a rewrite's (sum_grads_over_tp on Qwen3's per-head q/k norms) would
    # be lost, and each TP rank would train its copy of the norm on its own heads' gradient alone.
    for hook in (old._backward_hooks or {}).values():
        new.register_hook(hook)
    tag(new, SliceTag(t.dense, tuple(t.shape), t.dim, tuple(t.ranges or ()), t.transpose))  # for export
    return new


def _check_finite(name: str, value: Tensor) -> None:
    """Refuse a 16-bit value that is not finite: the cast of a pretrained weight beyond fp16's range gives inf
    silently (precision.match_precision sees only the cast values), and a checkpoint's own inf/NaN would train
    as NaN from the first step."""
    if value.dtype in (torch.float16,
                       torch.bfloat16) and value.numel() and not bool(torch.isfinite(value).all()):
        top = torch.finfo(value.dtype).max
        raise WeightRangeError(f"{name} is not finite in {str(value.dtype).replace('torch.', '')} (beyond "
                               f"its largest value {top:.6g}, or inf/NaN in the checkpoint): "
                               f"training.precision bf16 (or fp32) keeps such weights; a "
                               f"checkpoint holding inf/NaN must be repaired")


def _restore_buffers(root: nn.Module) -> None:
    """Recompute the buffers a rewrite built on meta (the column layers' gather permutation)."""
    from dsforge.runtime.layers import ColumnParallelLinear

    for module in root.modules():
        if isinstance(module, ColumnParallelLinear) and module._gather_order is not None \
                and module._gather_order.device.type == "meta":
            order = gathered_order(module.local_widths, module.tp)
            module._gather_order = None if order is None else torch.tensor(order)


def materialize_dense(model: nn.Module, source: WeightSource,
                      dtype: torch.dtype = torch.float32) -> nn.Module:
    """Every parameter of a dense (unrewritten) model on meta made real from ``source``; returns the model."""
    targets = []
    for name, p in model.named_parameters():
        holder, attr = _param_slot(model, name)
        targets.append(Target(holder, attr, name, tuple(p.shape)))
    materialize(targets, source, dtype, model)
    return model


def meta_leftovers(module: nn.Module) -> list[str]:
    """Names of parameters and buffers still on the meta device."""
    out = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    return out + [n for n, b in module.named_buffers() if b.device.type == "meta"]


def check_real(module: nn.Module, what: str) -> None:
    """Raise unless every parameter and buffer of ``module`` holds values."""
    left = meta_leftovers(module)
    if left:
        raise MaterializeError(f"{what}: {len(left)} tensor(s) were planned but never given values: "
                               f"{', '.join(left[:6])}")
