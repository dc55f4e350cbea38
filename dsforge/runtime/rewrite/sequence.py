"""Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) around HF decoder blocks.

Between tensor-parallel blocks the residual stream, its norms and dropout hold 1/tp of the
sequence. HF attention modules size their views from their *input's* sequence length and get
RoPE tables sized by the model, so the all-gather cannot hide inside the q/k/v layers as in
Megatron: each TP block (the parent of a column-parallel module, or an MoE block) becomes a
``SequenceRegion`` that gathers the sequence on entry, and its row-parallel layer reduce-scatters
on exit. For backward the block's column-parallel layers still keep only this rank's shard of the
gathered input, as Megatron's do (dsforge.runtime.layers.gathered_input), and gather it again once. The
embeddings stay whole (all-reduce), so HF computes positions for the whole sequence, and the first decoder
layer splits them (``SequenceEntry``); the final norm gathers them again (``SequenceExit``) before HF reshapes
them (GPT-2 views them as [-1, seq, hidden]) and the LM head.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.layers import gather_from_sequence, scatter_to_sequence
from dsforge.runtime.layers.gathered_input import gathered_input
from dsforge.runtime.rewrite.planner import RewriteError, RewritePlan


def _split_hidden(args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[Tensor, tuple[Any, ...], dict[str, Any]]:
    """The hidden states (first positional, or HF's ``hidden_states=``) apart from the other arguments."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("hidden_states"), (), rest


class SequenceRegion(nn.Module):
    """A TP block run on the whole sequence: all-gather in; a replicated output (MoE) is split again."""

    def __init__(self, block: nn.Module, pg: Any) -> None:
        super().__init__()
        self.block, self.pg = block, pg

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the sequence, run the block, keep this rank's sequence slice of its output."""
        hidden, args, kwargs = _split_hidden(args, kwargs)
        # Inside, every consumer enters the TP region through copy_to_tp (whose backward already
        # sums over the group), so the gather's backward only keeps this rank's slice.
        # HF blocks .view() it
        full = gather_from_sequence(hidden, self.pg, 1, grad_is_partial=False).contiguous()
        with gathered_input(full, hidden, self.pg, 1):  # its column-parallel layers save the shard, not
                                                        # `full`
            out = self.block(full, *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if first.shape[1] == full.shape[1] != hidden.shape[1]:
            first = scatter_to_sequence(first, self.pg, 1)  # no row-parallel exit: replicated result
        return (first, *out[1:]) if isinstance(out, tuple) else first


class SequenceEntry(nn.Module):
    """The first decoder layer: the replicated embeddings are split along the sequence before it."""

    def __init__(self, layer: nn.Module, pg: Any) -> None:
        super().__init__()
        self.layer, self.pg = layer, pg

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Split the sequence, run the layer."""
        hidden, args, kwargs = _split_hidden(args, kwargs)
        return self.layer(scatter_to_sequence(hidden, self.pg, 1), *args, **kwargs)


class SequenceExit(nn.Module):
    """The final norm: its output gathered along the sequence for the LM head (and HF's reshapes after it)."""

    def __init__(self, norm: nn.Module, pg: Any) -> None:
        super().__init__()
        self.norm, self.pg = norm, pg

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalise this rank's slice, gather the whole sequence (the head enters TP through copy_to_tp)."""
        return gather_from_sequence(self.norm(hidden), self.pg, 1, grad_is_partial=False).contiguous()


def region_names(rp: RewritePlan) -> list[str]:
    """The TP blocks of the plan: parents of column-parallel modules and the MoE blocks holding experts."""
    names: list[str] = []
    for m in rp.modules:
        parent = m.name.rpartition(".")[0]
        if m.variant in ("column", "expert") and m.layer is not None and parent and parent not in names:
            names.append(parent)
    return names


def wrap_sequence_parallel(model: nn.Module, rp: RewritePlan, groups: ParallelGroups,
                           only: set[str] | None = None) -> None:
    """Wrap the plan's TP blocks as sequence regions and the first decoder layer as the entry (in place)."""
    if rp.layer_list is None or rp.arch not in ("gpt2", "llama", "mixtral"):
        raise RewriteError(rp.arch, [("sequence parallelism needs a known decoder structure (gpt2, llama, "
                                      "mixtral); set parallel.sequence_parallel: false for this model")])
    pg = groups.tp
    for name in region_names(rp):
        if only is None or any(n.startswith(name + ".") for n in only):
            _wrap(model, name, SequenceRegion(model.get_submodule(name), pg))
    first = f"{rp.layer_list}.0"
    if only is None or any(n.startswith(first + ".") for n in only):
        _wrap(model, first, SequenceEntry(model.get_submodule(first), pg))
    for m in rp.modules:  # the final norm: the only norm outside the decoder layers
        if m.variant == "norm" and m.layer is None and (only is None or m.name in only):
            _wrap(model, m.name, SequenceExit(model.get_submodule(m.name), pg))


def _wrap(model: nn.Module, name: str, wrapper: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, wrapper)
