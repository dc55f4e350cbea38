"""The layout-free state's slice mapping, without a launch: pieces saved under one layout, re-cut for another.

A dense tensor is cut as dsforge.runtime.materialize cuts weights (column cuts take each rank's share
of every fused block, row cuts one contiguous share, experts one row of the stacked tensor, HF Conv1D
transposed), written in the files save_state writes (safetensors, slice tags in the metadata), then
read back with the reader a rank of the new layout uses: every slice of every other layout must equal
the same cut of the original. What the reader refuses is checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from dsforge.runtime.train_state import STATE_DIR, TrainStateError, _Pieces, cut, load_state
from dsforge.runtime.weights_io import SliceTag


def tp_tag(name: str, shape: tuple[int, ...], dim: int | None, blocks: int, tp: int, rank: int,
           transpose: bool = False) -> SliceTag:
    """Rank ``rank``'s tag of a ``tp``-way cut along ``dim`` with ``blocks`` fused blocks (None: whole)."""
    if dim is None:
        return SliceTag(name, shape, None, (), transpose)
    width = shape[dim] // blocks
    share = width // tp
    return SliceTag(name, shape, dim, tuple((b * width + rank * share, share) for b in range(blocks)),
                    transpose)


def local_shape(t: SliceTag) -> tuple[int, ...]:
    shape = list(t.shape)
    if t.dim is not None:
        shape[t.dim] = sum(n for _, n in t.ranges)
    return tuple(reversed(shape)) if t.transpose else tuple(shape)


def write_rank(directory: Path, rank: int, pieces: list[tuple[SliceTag, str, torch.Tensor]]) -> None:
    """One old rank's file, as save_state writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {}
    for i, (t, state, value) in enumerate(pieces):
        tensors[f"t{i}.{state}"] = value.contiguous()
        meta[f"t{i}.{state}"] = {"tag": t.to_json(), "state": state}
    save_file(tensors, str(directory / f"rank{rank}.safetensors"), metadata={"dsforge": json.dumps(meta)})


@settings(max_examples=40, deadline=None)
@given(blocks=st.sampled_from([1, 3]), tp_old=st.sampled_from([1, 2, 4]), tp_new=st.sampled_from([1, 2, 4]),
       dim_old=st.sampled_from([None, 0, 1]), dim_new=st.sampled_from([None, 0, 1]),
       replicas=st.integers(1, 2), transpose=st.booleans(), seed=st.integers(0, 2**16))
def test_pieces_of_one_layout_recut_for_another_equal_the_dense_cut(
        tmp_path_factory: pytest.TempPathFactory, blocks: int, tp_old: int, tp_new: int, dim_old: int | None,
        dim_new: int | None, replicas: int, transpose: bool, seed: int) -> None:
    shape = (24, 12)  # divisible by every blocks x tp drawn, along both dimensions
    dense = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    momentum = dense * 0.5 + 1
    directory = tmp_path_factory.mktemp("state") / STATE_DIR
    for copy in range(replicas):  # a tied weight (or a replica) saved twice: the first copy is taken
        for r in range(tp_old):
            t = tp_tag("w", shape, dim_old, blocks, tp_old, r, transpose)
            write_rank(directory, copy * tp_old + r, [(t, "fp32", cut(dense, t, local_shape(t))),
                                                      (t, "momentum_buffer",
                                                       cut(momentum, t, local_shape(t)))])
            if dim_old is None:
                break
    import contextlib

    with contextlib.ExitStack() as stack:
        pieces = _Pieces(directory, stack)
        assert torch.equal(pieces.dense("w", "fp32"), dense)
        for r in range(tp_new):
            t = tp_tag("w", shape, dim_new, blocks, tp_new, r, transpose)
            want = dense if dim_new is None else torch.cat([dense.narrow(dim_new, s, n) for s, n in t.ranges],
                                                           dim_new)
            want = want.t() if transpose else want
            assert torch.equal(cut(pieces.dense("w", "fp32"), t, local_shape(t)), want)
            assert torch.equal(cut(pieces.dense("w", "momentum_buffer"), t, local_shape(t)), want * 0.5 + 1)


def test_one_expert_of_the_stacked_experts(tmp_path: Path) -> None:
    stacked = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)
    old = [SliceTag("experts.down_proj", (4, 6, 2), 0, ((e, 1),)) for e in range(4)]  # ep4: one expert a rank
    write_rank(tmp_path / STATE_DIR, 0, [(t, "fp32", stacked[e]) for e, t in enumerate(old)])
    import contextlib

    with contextlib.ExitStack() as stack:
        whole = _Pieces(tmp_path / STATE_DIR, stack).dense("experts.down_proj", "fp32")
    two = SliceTag("experts.down_proj", (4, 6, 2), 0, ((2, 1),))  # ep2 holds experts one at a time too
    assert torch.equal(cut(whole, two, (6, 2)), stacked[2])


def test_a_missing_piece_or_another_shape_names_the_tensor(tmp_path: Path) -> None:
    import contextlib

    half = tp_tag("lm_head.weight", (8, 4), 0, 1, 2, 0)
    write_rank(tmp_path / STATE_DIR, 0, [(half, "fp32", torch.ones(4, 4))])  # rank 1's file is gone
    with contextlib.ExitStack() as stack:
        pieces = _Pieces(tmp_path / STATE_DIR, stack)
        with pytest.raises(TrainStateError, match=r"DSF642: no rank saved part of lm_head.weight"):
            pieces.dense("lm_head.weight", "fp32")
        with pytest.raises(TrainStateError, match=r"DSF642: no rank of the checkpoint saved the exp_avg of"):
            pieces.dense("lm_head.weight", "exp_avg")
    with pytest.raises(TrainStateError, match=r"DSF642: the checkpoint's w is \[8, 4\], this layout's dense"):
        cut(torch.zeros(8, 4), SliceTag("w", (16, 4), None, ()), (16, 4))


def test_a_checkpoint_without_layout_free_state_is_refused_before_the_engine_is_touched(
    tmp_path: Path,
) -> None:
    with pytest.raises(TrainStateError, match=r"DSF641: .* holds no layout-free state"):
        load_state(None, tmp_path)
    (tmp_path / STATE_DIR).mkdir()
    (tmp_path / STATE_DIR / "state.json").write_text(
        json.dumps({"format": 1, "step": 3, "unsupported": "ZeRO-3 swaps its state to NVMe"})
    )
    with pytest.raises(TrainStateError, match=r"DSF643: .*NVMe"):
        load_state(None, tmp_path)
