"""The arithmetic of building only a rank's shard: seeded slices, the slice rule per variant, and
reassembly."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dsforge.runtime import materialize
from dsforge.runtime.layers.sharding import shard_blocks, split_sizes
from dsforge.runtime.materialize import InitSpec, chunked_init, owned_ranges, params_on_meta
from dsforge.runtime.rewrite.planner import ModulePlan
from dsforge.runtime.rewrite.shard import ParamShard
from dsforge.runtime.weights_io import SliceTag, assemble


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 12), chunk=st.integers(1, 64),
       dim=st.sampled_from([0, 1]), data=st.data())
def test_a_seeded_slice_equals_the_slice_of_the_whole(rows: int, cols: int, chunk: int, dim: int,
                                                      data: st.DataObject) -> None:
    """Chunked draws: any set of ranges along either dimension reproduces those elements of the whole
    tensor."""
    old = materialize.CHUNK_ELEMENTS
    materialize.CHUNK_ELEMENTS = chunk  # small chunks, so slices straddle chunk boundaries
    try:
        spec = InitSpec(data.draw(st.integers(0, 500)), "normal", 0.02)
        whole = chunked_init(7, spec, (rows, cols))
        n = (rows, cols)[dim]
        cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=6)))
        ranges = [(a, b - a) for a, b in pairwise(cuts) if b > a] or [(0, n)]
        got = chunked_init(7, spec, (rows, cols), dim, ranges)
        want = torch.cat([whole.narrow(dim, s, length) for s, length in ranges], dim=dim)
        assert torch.equal(got, want)
        # drawn in fp32, cast chunk by chunk: the same values as casting the fp32 slice
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(chunked_init(7, spec, (rows, cols), dim, ranges, dtype), want.to(dtype))
    finally:
        materialize.CHUNK_ELEMENTS = old


def test_seeds_give_different_streams_per_parameter_and_chunk() -> None:
    a = chunked_init(1, InitSpec(0, "normal", 1.0), (64,))
    b = chunked_init(1, InitSpec(1, "normal", 1.0), (64,))
    c = chunked_init(2, InitSpec(0, "normal", 1.0), (64,))
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(chunked_init(1, InitSpec(3, "ones"), (2, 3)), torch.ones(2, 3))


def _entry(variant: str, fused: int = 1) -> ModulePlan:
    return ModulePlan("m", "Linear", variant, "test", "linear", None, [], fused=fused)


@settings(max_examples=80, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), fused=st.integers(1, 3), per=st.integers(1, 5),
       cols=st.integers(1, 6), data=st.data())
def test_the_column_and_row_slices_are_the_ones_from_dense_cuts(tp: int, fused: int, per: int, cols: int,
                                                                 data: st.DataObject) -> None:
    """owned_ranges gives the rows shard_blocks (what ColumnParallelLinear.from_dense keeps) takes, per
    rank."""
    rank = data.draw(st.integers(0, tp - 1))
    out = fused * tp * per
    weight = torch.arange(out * cols, dtype=torch.float32).reshape(out, cols)
    column = ParamShard("weight", (out, cols), (out // tp, cols), 0)
    ranges = owned_ranges(_entry("column", fused), column, rank, tp)
    mine = torch.cat([weight.narrow(0, s, n) for s, n in ranges])
    assert torch.equal(mine, shard_blocks(weight, [out // fused] * fused, rank, tp))
    row = ParamShard("weight", (cols, out), (cols, out // tp), 1)
    (start, length), = owned_ranges(_entry("row"), row, rank, tp)
    assert torch.equal(weight.t().narrow(1, start, length), shard_blocks(weight.t(), [out], rank, tp, dim=1))


@given(vocab=st.integers(1, 300), tp=st.sampled_from([1, 2, 3, 4]))
def test_vocab_slices_tile_the_table(vocab: int, tp: int) -> None:
    p = ParamShard("weight", (vocab, 4), (vocab // tp, 4), 0)
    spans = [owned_ranges(_entry("vocab"), p, r, tp)[0] for r in range(tp)]
    assert [n for _, n in spans] == split_sizes(vocab, tp)
    assert sum(n for _, n in spans) == vocab and all(s == sum(split_sizes(vocab, tp)[:r]) for r, (s, _) in
                                                     enumerate(spans))


@settings(max_examples=80, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), fused=st.integers(1, 3), transpose=st.booleans())
def test_assemble_inverts_the_cuts(tp: int, fused: int, transpose: bool) -> None:
    out, cols = fused * tp * 2, 3
    dense = torch.randn(out, cols)
    entry = _entry("column", fused)
    p = ParamShard("weight", (out, cols), (out // tp, cols), 0)
    slices = []
    for r in range(tp):
        ranges = owned_ranges(entry, p, r, tp)
        piece = torch.cat([dense.narrow(0, s, n) for s, n in ranges])
        slices.append((SliceTag("w", (out, cols), 0, tuple(ranges), transpose),
                       piece.t() if transpose else piece))
    slices.append((SliceTag("b", (cols,), None, ()), torch.ones(cols)))
    got = assemble(slices)
    assert torch.equal(got["w"], dense) and torch.equal(got["b"], torch.ones(cols))
    if tp > 1:
        with pytest.raises(ValueError, match="no rank saved part of w"):
            assemble(slices[1:])
    with pytest.raises(ValueError, match="different values"):
        assemble(slices + [(SliceTag("b", (cols,), None, ()), torch.zeros(cols))])


def test_params_on_meta_keeps_buffers_and_ties() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("freq", torch.arange(3.0), persistent=False)

    with params_on_meta():
        m = Tied()
    assert m.embed.weight.is_meta and m.head.weight is m.embed.weight
    assert not m.freq.is_meta and torch.equal(m.freq, torch.arange(3.0))
    assert not nn.Linear(2, 2).weight.is_meta  # the patch ends with the context


def test_a_checkpoint_without_a_parameter_or_with_another_shape_is_refused() -> None:
    """DSF640: the rank names the tensor instead of training from made-up weights."""
    from dsforge.runtime.materialize import PretrainedWeights
    from dsforge.runtime.models import ModelBuildError
    from dsforge.runtime.pretrained import CheckpointReader
    from tests.conftest import ROOT

    reader = CheckpointReader(ROOT / "tests" / "fixtures" / "pretrained" / "tiny-llama")
    source = PretrainedWeights(reader)
    got = source.values("model.norm.weight", (32,), None, None)
    assert got.shape == (32,) and reader.reads[-1]["key"] == "model.norm.weight"
    half = source.values("model.embed_tokens.weight", (128, 32), 0, [(64, 64)])
    assert half.shape == (64, 32) and reader.reads[-1]["ranges"] == [[64, 64]]
    with pytest.raises(ModelBuildError,
                       match="DSF640.*no tensor for the model's parameter model.extra.weight"):
        source.values("model.extra.weight", (4,), None, None)
    with pytest.raises(ModelBuildError, match=r"DSF640.*model.norm.weight is \[32\].*is \[64\]"):
        source.values("model.norm.weight", (64,), None, None)
    reader.close()


class _Constant:
    """A weight source that gives every parameter one value."""

    def __init__(self, value: float) -> None:
        self.value = value

    def values(self, name: str, shape: tuple[int, ...], dim: int | None, ranges: object,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(shape, self.value)


@pytest.mark.parametrize(("value", "dtype", "refused"),
                         [(1.0e6, torch.float16, True), (1.0e6, torch.bfloat16, False),
                                                         (float("nan"), torch.bfloat16, True),
                                                         (6.0e4, torch.float16, False)])
def test_a_weight_the_cast_makes_infinite_is_refused(value: float, dtype: torch.dtype, refused: bool) -> None:
    """fp16's largest value is 65,504: casting a larger pretrained weight gives inf, which would train as
    NaN."""
    with params_on_meta():
        model = nn.Linear(4, 3)
    if refused:
        with pytest.raises(materialize.WeightRangeError, match="weight is not finite in"):
            materialize.materialize_dense(model, _Constant(value), dtype)
    else:
        materialize.materialize_dense(model, _Constant(value), dtype)
        assert model.weight.dtype == dtype and bool(torch.isfinite(model.weight).all())
