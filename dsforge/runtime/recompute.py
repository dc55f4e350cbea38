"""Activation recomputation as ``training.recompute`` names it (Korthikanti et al. 2022, sec. 5; Chen et al.
2016).

* ``full``: every decoder layer is checkpointed. Its forward runs without saving anything; only its
  input is kept (1/tp of it when ``activation_checkpointing.partition_activations`` is on and the
  input is replicated over the TP group, Megatron's distribute-saved-activations), and the backward
  runs the layer again before differentiating it. This is the reentrant scheme Megatron and
  ``deepspeed.checkpointing`` use, written here so that the kept input is an ordinary saved tensor
  (autograd's saved-tensor hooks, and so dsforge's activation probe, see exactly what is kept) and so
  that the ds_config's ``partition_activations`` is honoured: DeepSpeed reads it only after a
  ``deepspeed.checkpointing.configure`` call that nothing in a DeepSpeed engine makes.
* ``selective``: recompute the attention core (scores, softmax, dropout on them). dsforge's models
  run attention through SDPA (flash kernels) or dsforge's ring attention, and both already keep no
  s x s tensor: they save q, k, v, the output and an fp32 log-sum-exp and recompute the scores in their
  backward. What selective recomputation would drop is therefore already dropped, and nothing else
  is recomputed: the kept bytes equal ``none``'s, as the cost model (``HF_SDPA`` kernels) says.
* ``none``: every saved tensor is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsforge.runtime.errors import EngineError


class RecomputeError(EngineError):
    """Recomputation cannot be applied to this model as the job asks (no decoder layers found; an EngineError,
    so `dsforge run` reports it in one line)."""


def _partition(x: Tensor, group: Any) -> Tensor:
    """This rank's contiguous 1/n of ``x``'s elements (a copy, so the whole tensor can be freed)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    flat = x.detach().reshape(-1)
    size = flat.numel() // n
    return flat.narrow(0, me * size, size).clone()


def _unpartition(part: Tensor, group: Any, shape: torch.Size) -> Tensor:
    """The whole tensor from every rank's partition (all-gather over ``group``)."""
    pieces = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, part.contiguous(), group=group)
    return torch.cat(pieces).view(shape)


def _splits(x: Any, group: Any) -> bool:
    return (group is not None and isinstance(x, Tensor) and x.is_floating_point()
            and x.numel() % dist.get_world_size(group) == 0)


class _Checkpoint(torch.autograd.Function):
    """Run ``fn`` without saving its activations; keep its (partitioned) tensor inputs; recompute in
    backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], group: Any, *args: Any) -> Any:
        ctx.fn, ctx.group = fn, group
        ctx.cpu_rng = torch.get_rng_state()  # dropout in the recomputation draws what the forward drew
        ctx.cuda_rng = torch.cuda.get_rng_state() if any(
            isinstance(a, Tensor) and a.is_cuda for a in args) else None
        ctx.slots, ctx.shapes, ctx.others = [], [], []
        kept = []
        for a in args:
            if isinstance(a, Tensor):
                split = _splits(a, group)
                ctx.slots.append(("split" if split else "tensor", a.requires_grad))
                ctx.shapes.append(a.shape)
                kept.append(_partition(a, group) if split else a)
            else:
                ctx.slots.append(("other", False))
                ctx.others.append(a)
        ctx.save_for_backward(*kept)
        with torch.no_grad():
            out = fn(*args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        kept, others = list(ctx.saved_tensors), iter(ctx.others)
        inputs: list[Any] = []
        tensors = iter(zip(kept, ctx.shapes))
        for kind, needs_grad in ctx.slots:
            if kind == "other":
                inputs.append(next(others))
                continue
            t, shape = next(tensors)
            t = _unpartition(t, ctx.group, shape) if kind == "split" else t
            inputs.append(t.detach().requires_grad_(needs_grad))
        devices = [torch.cuda.current_device()] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = [x.grad if isinstance(x, Tensor) and needs else None
                    for x, (_, needs) in zip(inputs, ctx.slots)]
        return (None, None, *in_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, group: Any = None) -> Any:
    """``fn(*args)`` keeping only its tensor inputs for backward (split over ``group`` when given).

    Keyword tensors bound into ``fn`` (HF's rotary tables and masks) are constants of the
    recomputation: they must not need gradients. Without any input that needs a gradient (token
    ids), the call runs as is: a reentrant checkpoint would cut its parameters off from the backward.
    """
    if not torch.is_grad_enabled() or not any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return _Checkpoint.apply(fn, group, *args)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: HF's checkpointable layers, else the items of its longest ModuleList."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    hf = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if hf:
        return hf
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    best = max(lists, key=len, default=None)
    return list(best) if best is not None else []


def _checkpoint_forward(layer: nn.Module, group: Any) -> None:
    """Checkpoint one layer's forward (keyword arguments bound, positional ones kept)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if isinstance(layer, GradientCheckpointingLayer):
        # HF's own hook (GradientCheckpointingLayer.forward): it binds the keywords and passes the hidden
        # states positionally to the function set here, only while training with gradients on.
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, group=group)
        return
    inner = layer.forward

    @wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not layer.training:
            return inner(*args, **kwargs)
        return checkpoint(partial(inner, **kwargs), *args, group=group)

    layer.forward = forward  # type: ignore[method-assign]


def apply_recompute(model: nn.Module, recompute: str, partition_group: Any = None) -> int:
    """Make ``model`` recompute as ``training.recompute`` says; returns the number of checkpointed layers.

    ``partition_group``: the TP group when checkpointed inputs are replicated over it and the ds_config
    partitions them (``partition_activations``), else None.
    """
    if recompute != "full":
        return 0  # selective: nothing left to recompute under SDPA and ring attention (module doc)
    layers = decoder_layers(model)
    if not layers:
        raise RecomputeError(f"training.recompute: full checkpoints each decoder layer, and "
                             f"{type(model).__name__} has none dsforge can find (no HF decoder layer, no "
                             "nn.ModuleList); use recompute none or "
                             "selective, or build the layers in a ModuleList")
    for layer in layers:
        _checkpoint_forward(layer, partition_group)
    return len(layers)


def partition_group(ds_config: dict[str, Any], tp_group: Any, tp: int, sequence_parallel: bool) -> Any:
    """The group checkpointed layer inputs are split over: TP when the ds_config partitions them and they are
    replicated there (under sequence parallelism each TP rank already holds its own slice), else None."""
    block = ds_config.get("activation_checkpointing") or {}
    if tp > 1 and not sequence_parallel and isinstance(block, dict) and block.get("partition_activations"):
        return tp_group
    return None
