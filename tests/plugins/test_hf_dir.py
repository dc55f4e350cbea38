"""The prepared model's save_pretrained names DeepSpeed's consolidated tensors by their slice tags
(dsforge.plugins.hf_dir); the multi-process runs are the trainer tests' (test_hf.py, test_accelerate.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsforge.plugins.hf_dir import dense_state
from dsforge.plugins.job import PluginError
from dsforge.runtime.weights_io import SliceTag, tag


class Wrapper(nn.Module):
    """Stands in for sequence parallelism's wrapper: one more level in the module path."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner


def rank_model() -> nn.Module:
    """Rank 0 of tp=2: a column-split projection under a wrapper, and a tied, vocabulary-split head."""
    model = nn.Module()
    model.attn = Wrapper(nn.Linear(4, 3, bias=False))  # rank 0's 3 of 6 rows
    model.embed = nn.Embedding(5, 4)
    model.head = nn.Linear(4, 5, bias=False)
    model.head.weight = model.embed.weight
    tag(model.attn.block.weight, SliceTag("layers.0.attn.q.weight", (6, 4), 0, ((0, 3),)))
    tag(model.embed.weight, SliceTag("embed.weight", (10, 4), 0, ((0, 5),)))
    return model


def test_the_consolidated_paths_are_named_by_their_dense_parameters() -> None:
    model = rank_model()
    whole = {"attn.block.weight": torch.ones(6, 4), "embed.weight": torch.zeros(10, 4),
             "head.weight": torch.zeros(10, 4), "rotary.inv_freq": torch.ones(2)}
    dense = dense_state(model, whole)
    assert sorted(dense) == ["embed.weight", "layers.0.attn.q.weight"]  # the tied head once, no buffer
    assert dense["layers.0.attn.q.weight"] is whole["attn.block.weight"]


def test_one_ranks_slices_or_a_missing_parameter_are_refused() -> None:
    model = rank_model()
    with pytest.raises(PluginError, match=r"attn.block.weight: the state dict holds \[3, 4\], the dense "
                                          r"parameter layers.0.attn.q.weight is \[6, 4\]"):
        dense_state(model, model.state_dict())  # this rank's slices, not DeepSpeed's consolidation
    with pytest.raises(PluginError, match="the state dict lacks embed.weight"):
        dense_state(model, {"attn.block.weight": torch.ones(6, 4)})
    with pytest.raises(PluginError, match="embed.weight: two paths of one tied parameter hold different"):
        dense_state(model, {"attn.block.weight": torch.ones(6, 4), "embed.weight": torch.zeros(10, 4),
                            "head.weight": torch.ones(10, 4)})
