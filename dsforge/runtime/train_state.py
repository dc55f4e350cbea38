"""Layout-free training state inside a checkpoint: fp32 weights and optimizer state by dense tensor, and
counters.

DeepSpeed's own checkpoint holds flat ZeRO partitions whose boundaries depend on every degree, so
it loads only under the layout that wrote it. Beside it, each save writes ``dsforge-state/``:

* ``rank<N>.safetensors`` from every rank that holds a distinct copy of its slices (data-parallel
  index 0, as dsforge.runtime.weights_io): for each parameter, the fp32 master value and each
  element-wise optimizer state (SGD's ``momentum_buffer``, Adam's ``exp_avg`` / ``exp_avg_sq``) of
  the slice it holds, tagged with the dense tensor and slice (weights_io.SliceTag). Under ZeRO the
  values are DeepSpeed's fp32 partitions gathered over the data-parallel group through its
  tensor-fragment mapping (``deepspeed.utils.safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state``); at ZeRO-0 in fp32 they are the torch optimizer's own.
* ``state.json`` from rank 0: the step, the optimizer's scalar state (Adam's step count), its
  param group settings (the current learning rate), the engine's counters; ``scheduler.pt`` the
  learning-rate scheduler's state.

A run under another layout gives each of its parameters the values of its new slice: it opens the
old ranks' files, assembles only the dense tensors it holds a slice of (one at a time), cuts its
slice as dsforge.runtime.materialize cuts weights, and sets master weight, optimizer state and
model weight with ``safe_set_full_*`` (after creating the optimizer's state, which torch makes only
at the first step). Then the group settings, the scheduler and the counters. The data position is
the step: the stream is a pure function of it and the global batch (dsforge.runtime.data).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dsforge.runtime.errors import RuntimeRefusal
from dsforge.runtime.weights_io import SliceTag, assemble, replica_index, tagged

STATE_DIR = "dsforge-state"
META = "state.json"
SCHEDULER = "scheduler.pt"
FP32 = "fp32"  # the state name of the master weights
FORMAT = 1


class TrainStateError(RuntimeRefusal, RuntimeError):
    """The layout-free state cannot be written or set into this engine; the message has the rule id and a
    fix."""


def torch_optimizer(engine: Any) -> Any:
    """The torch optimizer that holds the state: ZeRO's and the bf16 wrapper's inner one, or the engine's
    own."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _mode(p: nn.Parameter) -> str:
    """How DeepSpeed keeps this parameter's fp32 state: ZeRO-3 partitions, a fragment mapping, or the
    parameter (or, under the unfused 16-bit wrapper, an fp32 copy of it: see ``_copies``)."""
    if hasattr(p, "ds_id"):
        return "zero3"
    if hasattr(p, "_hp_mapping"):
        return "mapped"
    return "plain"


def _copies(engine: Any) -> dict[int, Tensor]:
    """The fp32 copy of each 16-bit parameter that DeepSpeed's unfused wrapper keeps (bf16 at ZeRO-0), by id.

    The wrapper's fp16_groups and fp32_groups pair the model's parameters with the tensors its torch
    optimizer steps; other engines have none.
    """
    wrapper = engine.optimizer
    lows, highs = getattr(wrapper, "fp16_groups", None), getattr(wrapper, "fp32_groups", None)
    if not isinstance(lows, list) or not isinstance(highs, list) or hasattr(wrapper, "bit16_groups"):
        return {}
    return {id(lp): hp for low, high in zip(lows, highs) for lp, hp in zip(low, high)}


def unsupported(engine: Any, params: list[nn.Parameter]) -> str | None:
    """Why this engine's optimizer state cannot be read and set by dense tensor (None: it can)."""
    opt = torch_optimizer(engine)
    if not isinstance(opt, torch.optim.Optimizer):
        return f"its optimizer {type(opt).__name__} is not a torch optimizer"
    if getattr(getattr(engine, "optimizer", None), "swap_optimizer", False):
        return "ZeRO-3 swaps its optimizer state to NVMe"
    plain = [p for p in params if _mode(p) == "plain"]
    if plain:
        copies = _copies(engine)
        if copies and getattr(getattr(engine.optimizer, "loss_scale_config", None), "dynamic_loss_scale",
                              False):
            return f"{type(engine.optimizer).__name__} scales the loss dynamically (fp16 without ZeRO)"
        held = {id(q) for g in opt.param_groups for q in g["params"]}
        if any(id(copies.get(id(p), p)) not in held or copies.get(id(p),
                                                                  p).dtype != torch.float32 for p in plain):
            return (f"{type(engine.optimizer).__name__} keeps fp32 copies outside DeepSpeed's fragment "
                    f"mapping that dsforge cannot pair with the model's parameters")
    return None


def _hp_params(engine: Any, opt: Any) -> list[Tensor]:
    """The tensors the torch optimizer steps: ZeRO's flat fp32 partitions, or the parameters themselves.

    ZeRO-3 leaves its param groups empty between steps (it puts one sub-group's partition in at a time).
    """
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        return list(flats)
    return [hp for group in opt.param_groups for hp in group["params"]]


def _state_names(engine: Any, opt: Any) -> tuple[list[str], dict[str, Any]]:
    """The element-wise state keys of the optimizer and its scalar state (from the first parameter holding
    any)."""
    for hp in _hp_params(engine, opt):
        st = opt.state.get(hp)
        if not st:
            continue
        keys = sorted(k for k, v in st.items() if torch.is_tensor(v) and v.shape == hp.shape and v.dim() > 0)
        scalars: dict[str, Any] = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 0:
                scalars[k] = {"value": float(v), "tensor": True, "dtype": str(v.dtype).replace("torch.", "")}
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                scalars[k] = {"value": v, "tensor": False}
        return keys, scalars
    return [], {}


def _group_settings(opt: Any) -> dict[str, Any]:
    """The first param group's numeric settings (lr, momentum, betas, a fused optimizer's step)."""
    out: dict[str, Any] = {}
    for k, v in opt.param_groups[0].items():
        if isinstance(v, bool) or k == "params":
            continue
        if isinstance(v,
                      (int, float)) or (isinstance(v,
                                                   (list,
                                                    tuple)) and all(isinstance(x, (int, float)) for x in v)):
            out[k] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def _full(p: nn.Parameter, opt: Any, key: str | None, copies: dict[int, Tensor]) -> Tensor | None:
    """The fp32 value (``key`` None) or one optimizer state of this rank's whole parameter (collective under
    ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    mode = _mode(p)
    if mode == "plain":
        hp = copies.get(id(p), p)
        return hp.detach() if key is None else opt.state[hp][key].detach()
    value = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
    return None if value is None else value.detach()


def save_state(engine: Any, directory: Path, rank: int, step: int) -> Path | None:
    """Write this rank's layout-free state into ``directory/dsforge-state`` (collective: every rank calls it).

    Returns the state directory, or None when the engine's model is not one dsforge built (no slice tags).
    An engine whose optimizer keeps its state elsewhere gets a state.json saying why, and no tensors.
    """
    from safetensors.torch import save_file

    module = getattr(engine, "module", None)
    if not isinstance(module, nn.Module):
        return None
    params = tagged(module)
    if not params:
        return None
    out = directory / STATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    why = unsupported(engine, [p for p, _ in params])
    opt = torch_optimizer(engine)
    keys, scalars = ([], {}) if why else _state_names(engine, opt)
    keys = _agreed(keys)  # every rank gathers the same states: a rank without any would leave the others
                          # waiting
    if why is None:
        _relink(engine)
        copies = _copies(engine)
        tensors: dict[str, Tensor] = {}
        meta: dict[str, Any] = {}
        for i, (p, t) in enumerate(params):
            if not p.requires_grad:
                continue
            values = {name: _full(p, opt, None if name == FP32 else name, copies) for name in (FP32, *keys)}
            if replica_index(engine, p) != 0:
                continue
            for name, value in values.items():
                if value is None:
                    continue
                key = f"t{i}.{name}"
                tensors[key] = value.to("cpu").reshape(_local_shape(p)).contiguous().clone()
                meta[key] = {"tag": t.to_json(), "state": name}
        if tensors:
            save_file(tensors, str(out / f"rank{rank}.safetensors"), metadata={"dsforge": json.dumps(meta)})
    if rank == 0:
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            torch.save(scheduler.state_dict(), out / SCHEDULER)
        doc = {"format": FORMAT, "step": step, "unsupported": why, "keys": keys, "scalars": scalars,
               "group": {} if why else _group_settings(opt), "optimizer": type(opt).__name__,
               "engine": {k: int(getattr(engine, k, 0) or 0) for k in ("global_steps", "global_samples",
                                                                     "skipped_steps")}}
        (out / META).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return out


def _agreed(keys: list[str]) -> list[str]:
    """The state keys of every rank together (the same list on each)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keys
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    return sorted({k for ks in every for k in ks})


def _local_shape(p: nn.Parameter) -> tuple[int, ...]:
    """The shape of this rank's whole parameter (ZeRO-3 reports it before partitioning)."""
    return tuple(getattr(p, "ds_shape", p.shape))


class _Pieces:
    """The old ranks' saved pieces, by (dense tensor, state name), read only when asked for."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open

        self.where: dict[tuple[str, str], list[tuple[SliceTag, Any, str]]] = {}
        for path in sorted(directory.glob("rank*.safetensors")):
            fh = stack.enter_context(safe_open(str(path), framework="pt"))
            meta = json.loads((fh.metadata() or {}).get("dsforge", "{}"))
            for key in fh.keys():  # noqa: SIM118 -- a safetensors file handle is not a mapping
                entry = meta[key]
                tag = SliceTag.from_json(entry["tag"])
                self.where.setdefault((tag.dense, entry["state"]), []).append((tag, fh, key))
        self._cache: tuple[tuple[str, str], Tensor] | None = None

    def dense(self, name: str, state: str) -> Tensor:
        """The whole dense tensor ``name`` of state ``state``, assembled from every piece saved of it."""
        if self._cache is not None and self._cache[0] == (name, state):
            return self._cache[1]
        pieces = self.where.get((name, state))
        if not pieces:
            raise TrainStateError(f"DSF642: no rank of the checkpoint saved the {state} of {name}")
        try:
            whole: Tensor = assemble([(t, fh.get_tensor(key)) for t, fh, key in pieces],
                                     first_copy_wins=True)[name]
        except ValueError as exc:
            raise TrainStateError(f"DSF642: {exc}") from None
        self._cache = ((name, state), whole)
        return whole


def cut(dense: Tensor, t: SliceTag, shape: tuple[int, ...]) -> Tensor:
    """The slice ``t`` of a dense tensor in the layout of the parameter holding it (``shape``), as materialize
    cuts."""
    if tuple(dense.shape) != tuple(t.shape):
        raise TrainStateError(f"DSF642: the checkpoint's {t.dense} is {list(dense.shape)}, this layout's "
                              f"dense model has {list(t.shape)}")
    value = dense if t.dim is None else torch.cat([dense.narrow(t.dim, s, n) for s, n in t.ranges], dim=t.dim)
    if t.transpose:
        value = value.t()
    if t.dim == 0 and t.ranges and len(t.shape) == len(shape) + 1:
        value = value.reshape(shape)  # one expert out of the stacked experts
    if tuple(value.shape) != tuple(shape):
        raise TrainStateError(f"DSF642: {t.dense}: the slice this rank holds is {list(shape)}, the saved "
                              f"tensor cuts to {list(value.shape)}")
    return value.contiguous()


def _prime(engine: Any, opt: Any, keys: list[str], scalars: dict[str, Any]) -> None:
    """Create the optimizer state torch makes at the first step, so that it can be set, and link ZeRO's
    fragments."""
    for hp in _hp_params(engine, opt):
        st = opt.state[hp]
        for k in keys:
            st[k] = torch.zeros_like(hp)
        for k, s in scalars.items():
            st[k] = (torch.tensor(s["value"], dtype=getattr(torch, s.get("dtype", "float32")))
                     if s["tensor"] else s["value"])
    _relink(engine)


def _relink(engine: Any) -> None:
    """Point ZeRO-1/2's (and the bf16 wrapper's) fragment mapping at the optimizer state that exists now.

    DeepSpeed links it once, right after the first param group's first step: with several groups
    (MoE: experts apart) the later groups' state did not exist yet and their fragments hold no keys.
    """
    wrapper = engine.optimizer
    if hasattr(wrapper, "_lazy_init_hp_params_optimizer_state"):
        wrapper._hp_optimizer_states_linked = False
        wrapper._lazy_init_hp_params_optimizer_state()


def _set(p: nn.Parameter, opt: Any, values: dict[str, Tensor], copies: dict[int, Tensor]) -> None:
    """Give one parameter its fp32 master value, optimizer state and model weight."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    mode = _mode(p)
    master = values[FP32]
    if mode == "plain":
        hp = copies.get(id(p), p)
        with torch.no_grad():
            hp.copy_(master)
            if hp is not p:
                p.copy_(master.to(p.dtype))  # what the wrapper's step copies back
        for k, v in values.items():
            if k != FP32:
                opt.state[hp][k].copy_(v)
        return
    safe_set_full_fp32_param(p, master.to(torch.float32))
    for k, v in values.items():
        if k != FP32:
            safe_set_full_optimizer_state(p, v.to(torch.float32), k)
    if mode == "mapped":
        with torch.no_grad():
            p.data.copy_(master.to(p.dtype))  # DeepSpeed's own step copies the master into the model weight
                                              # too


def _zero3_weights(engine: Any) -> None:
    """ZeRO-3: copy the fp32 partitions just set into the model weights' partitions, as DeepSpeed's own
    universal-checkpoint load does (in fp32 the two are one tensor and the copy is a no-op)."""
    z3 = engine.optimizer
    for i, (lp, hp) in enumerate(zip(z3.fp16_partitioned_groups_flat, z3.fp32_partitioned_groups_flat)):
        if lp is None or hp.numel() == 0:
            continue
        lp.data.copy_(hp.data)
        for partitioned, q in zip(z3.fp16_partitioned_groups[i],
                                  z3.unflatten(lp, z3.fp16_partitioned_groups[i])):
            partitioned.data = q.data


def read_meta(path: Path) -> dict[str, Any] | None:
    """A checkpoint's state.json, or None when it has no layout-free state."""
    try:
        doc = json.loads((path / STATE_DIR / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def load_state(engine: Any, path: Path) -> int:
    """Set the layout-free state of the checkpoint ``path`` into this rank's engine; the step it had done.

    Not collective: each rank reads the pieces of the dense tensors it holds a slice of.
    """
    meta = read_meta(path)
    if meta is None or meta.get("format") != FORMAT:
        raise TrainStateError(f"DSF641: {path} holds no layout-free state ({STATE_DIR}/{META}): it was saved "
                              f"by an older dsforge or from a model dsforge did not build (model.factory); "
                              f"resume it under the layout that wrote it")
    if meta.get("unsupported"):
        raise TrainStateError(f"DSF643: {path} was saved by an engine whose optimizer state dsforge cannot "
                              f"read by tensor ({meta['unsupported']}); "
                              f"resume it under the layout that wrote it")
    module = engine.module
    params = tagged(module)
    why = unsupported(engine, [p for p, _ in params])
    if why:
        raise TrainStateError(f"DSF643: this layout's engine keeps its optimizer state where dsforge cannot "
                              f"set it ({why}); resume under the checkpoint's "
                              f"layout, or change the ZeRO stage")
    opt = torch_optimizer(engine)
    if type(opt).__name__ != meta.get("optimizer"):
        raise TrainStateError(f"DSF643: the checkpoint's optimizer is {meta.get('optimizer')}, this layout "
                              f"builds {type(opt).__name__}; resume under "
                              f"the checkpoint's layout or hardware kind")
    keys: list[str] = list(meta.get("keys", []))
    _prime(engine, opt, keys, meta.get("scalars", {}))
    copies = _copies(engine)
    with contextlib.ExitStack() as stack:
        pieces = _Pieces(path / STATE_DIR, stack)
        # one dense tensor assembled at a time
        order = sorted(((t.dense, i) for i, (_, t) in enumerate(params)))
        for _, i in order:
            p, t = params[i]
            if not p.requires_grad:
                continue
            shape = _local_shape(p)
            _set(p, opt, {s: cut(pieces.dense(t.dense, s), t, shape) for s in (FP32, *keys)}, copies)
    if any(_mode(p) == "zero3" for p, _ in params):
        _zero3_weights(engine)
    _restore_settings(engine, opt, meta, path)
    return int(meta["step"])


def _restore_settings(engine: Any, opt: Any, meta: dict[str, Any], path: Path) -> None:
    """The scheduler's state, the param groups' settings (the current learning rate) and the engine's
    counters."""
    scheduler = getattr(engine, "lr_scheduler", None)
    saved = path / STATE_DIR / SCHEDULER
    if scheduler is not None and hasattr(scheduler, "load_state_dict") and saved.is_file():
        scheduler.load_state_dict(torch.load(saved, weights_only=False))
    for group in opt.param_groups:
        for k, v in meta.get("group", {}).items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    for k, v in meta.get("engine", {}).items():
        if hasattr(engine, k):
            setattr(engine, k, int(v))
