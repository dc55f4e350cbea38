"""The plain HF directory of a tensor-parallel model, written by the trainers' own save calls.

The HF Trainer's ``trainer.save_model`` and accelerate's ``get_state_dict`` (which
``unwrap_model(model).save_pretrained(dir, state_dict=...)`` writes) take DeepSpeed's consolidation at
``tensor_parallel.autotp_size > 1`` once ``stage3_gather_16bit_weights_on_model_save`` is set:
``DeepSpeedEngine._replace_module_consolidated_state_dict`` walks the modules and, for each one holding a
parameter marked ``ds_is_replaced_module``, calls ``params[0].gather_params(params)``, reads the parameters
and then ``params[0]._tp_partition(params)`` (deepspeed/module_inject/layers.py
``GatherReplacedLayerParams``). ``install`` gives dsforge's parameters that protocol: the gather assembles
each parameter whole from its TP group's slices by their slice tags (dsforge.runtime.weights_io.assemble,
as `dsforge export` and ``parallel_model.save_hf`` do: fused and interleaved cuts, vocabulary rows, a
transposed Conv1D), and the partition puts back the very tensor the rank held (a view into ZeRO's flat
buffer stays that view).

The consolidated dict is keyed by the rank's module paths, which differ from the dense model's where the
rewrite wraps a module (sequence parallelism's ``layer``/``block``/``norm`` wrappers). The prepared model's
``save_pretrained`` therefore names each tensor by its slice tag and writes what ``save_hf`` writes
(``write``: config.json of the dense config, model.safetensors in the layout ``save_pretrained`` writes);
called without a state dict it is ``save_hf`` itself (every rank).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsforge.plugins.job import PluginError

#: Where a parameter keeps the tensor it held while the consolidation holds its whole value.
_HELD = "_dsforge_tp_held"


def write(dense: dict[str, Any], cfg: Any, directory: str | os.PathLike[str]) -> None:
    """Write config.json (``cfg``, the dense config) and model.safetensors of the dense state dict."""
    from safetensors.torch import save_file

    from dsforge.runtime.export import on_disk

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(cfg)
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in dense.values()})
    if len(dtypes) == 1:
        cfg.dtype = dtypes[0]
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(str(out))
    tensors = on_disk(dense, getattr(cfg, "model_type", None))
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")


def gather_params(params: list[Any], group: Any) -> None:
    """DeepSpeed's gather hook: each sliced parameter of one module holds its whole dense value (collective
    over the TP ``group``, bound by `install`)."""
    import torch
    import torch.distributed as dist

    from dsforge.runtime.weights_io import TAG, SliceTag, assemble

    for p in params:
        t = None if p is None else getattr(p, TAG, None)
        if t is None or t.dim is None or getattr(p, _HELD, None) is not None:
            continue  # replicated (whole on every rank), or already held whole (a tied weight)
        pieces: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(pieces, (t.to_json(), p.detach().to("cpu")), group=group)
        whole = assemble([(SliceTag.from_json(j), v) for j, v in pieces])[t.dense]
        setattr(p, _HELD, p.data)
        with torch.no_grad():
            p.data = whole.to(device=p.device, dtype=p.dtype)


def partition_params(params: list[Any]) -> None:
    """DeepSpeed's partition hook: each parameter gets back the very tensor it held before the gather."""
    for p in params:
        held = getattr(p, _HELD, None)
        if p is not None and held is not None:
            p.data = held
            delattr(p, _HELD)


def install(model: Any, group: Any, save_hf: Callable[[Any, Any], None], config: Any) -> None:
    """Give the prepared model's parameters DeepSpeed's TP gather protocol over the TP ``group`` and the
    model a dense ``save_pretrained`` (tp > 1): ``save_hf`` writes the directory collectively, ``config`` is
    the dense model's HF config."""
    from functools import partial

    from dsforge.runtime.weights_io import TAG

    for p in model.parameters():
        t = getattr(p, TAG, None)
        if t is None:
            continue
        # Every tagged parameter carries the hooks: DeepSpeed calls them on a module's first parameter,
        # which may be a replicated bias next to a sliced weight.
        p.gather_params = partial(gather_params, group=group)
        p._tp_partition = partition_params
        if t.dim is not None:
            p.ds_is_replaced_module = True
    # An instance attribute, so that Trainer._save's and accelerate users' model.save_pretrained(...) find it.
    model.save_pretrained = _DenseSave(model, save_hf, config)


def dense_names(model: Any) -> dict[str, Any]:
    """Each parameter path of the rank's model (tied ones under every path) -> its slice tag."""
    from dsforge.runtime.weights_io import TAG

    return {n: getattr(p, TAG) for n, p in model.named_parameters(remove_duplicate=False)
            if getattr(p, TAG, None) is not None}


def dense_state(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The consolidated ``state_dict`` (the rank's module paths, whole tensors) by dense names; PluginError
    when a tensor is not the dense parameter's whole value (a state dict of one rank's slices)."""
    import torch

    tags = dense_names(model)
    dense: dict[str, Any] = {}
    for key, value in state_dict.items():
        t = tags.get(key)
        if t is None:
            continue  # a buffer: the model recomputes it (save_hf writes parameters only)
        if tuple(value.shape) != tuple(t.shape):
            raise PluginError(
                f"{key}: the state dict holds {list(value.shape)}, the dense parameter {t.dense} is "
                f"{list(t.shape)}: pass accelerator.get_state_dict(model) (DeepSpeed's consolidation, "
                f"gathered from the slices), not one rank's model.state_dict()")
        if t.dense in dense and not torch.equal(dense[t.dense], value):
            raise PluginError(f"{t.dense}: two paths of one tied parameter hold different values")
        dense[t.dense] = value
    missing = sorted({t.dense for t in tags.values()} - set(dense))
    if missing:
        raise PluginError(f"the state dict lacks {', '.join(missing[:4])}: pass "
                          f"accelerator.get_state_dict(model), DeepSpeed's consolidation of every parameter")
    return dense


class _DenseSave:
    """``save_pretrained`` of a prepared tp > 1 model: the dense HF directory ``save_hf`` writes."""

    def __init__(self, model: Any, save_hf: Callable[[Any, Any], None], config: Any) -> None:
        import weakref

        self._model = weakref.ref(model)  # no reference cycle through the model's own __dict__
        self._save_hf, self._config = save_hf, config

    def __call__(self, save_directory: str | os.PathLike[str], is_main_process: bool = True,
                 state_dict: dict[str, Any] | None = None, **ignored: Any) -> None:
        """With ``state_dict`` (DeepSpeed's consolidation, on the writing rank): rename and write. Without it
        on a rank that does not write: nothing (the consolidation gave it None); otherwise
        ``parallel_model.save_hf`` (collective: every rank calls ``save_pretrained(dir)``)."""
        if ignored.get("push_to_hub"):
            raise PluginError("save_pretrained(push_to_hub=True) of a tensor-parallel model: save the "
                              "directory, then upload it with huggingface_hub")
        model = self._model()
        if state_dict is None and not is_main_process:
            return
        if state_dict is None:
            self._save_hf(model, save_directory)
            return
        dense = dense_state(model, state_dict)
        if is_main_process:
            write(dense, self._config, save_directory)
