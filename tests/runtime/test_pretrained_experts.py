"""MoE checkpoints as save_pretrained writes them (one tensor per expert and projection) read as the model's
stacks.

transformers 5 holds a Mixtral / Qwen2-MoE / Qwen3-MoE block's experts stacked (``experts.gate_up_proj``
[E, 2F, H], ``experts.down_proj`` [E, H, F]) but writes, and reads back, one tensor per expert; Mixtral's
``block_sparse_moe`` is the model's ``mlp``. The reader must give every parameter of the model
``from_pretrained`` builds exactly, any slice of a stack by reading only the experts, rows or columns in
it, and export must write what save_pretrained writes.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.runtime.export import on_disk
from dsforge.runtime.pretrained import CheckpointReader, PretrainedLoadError

EXPERTS, HIDDEN, FFN = 4, 32, 24
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _tiny(kind: str) -> Any:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = {"vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
                              "max_position_embeddings": 64}
    torch.manual_seed(3)
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=FFN, num_local_experts=EXPERTS, **common)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=FFN, num_experts=EXPERTS, **common)
    else:
        cfg = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=FFN,
                             shared_expert_intermediate_size=40, num_experts=EXPERTS, **common)
    return AutoModelForCausalLM.from_config(cfg)


class Saved(dict[str, tuple[Path, dict[str, torch.Tensor]]]):
    """family -> (its save_pretrained directory, the parameters from_pretrained builds from it)."""

    def __repr__(self) -> str:  # hypothesis prints its arguments on failure: not every tensor
        return f"Saved({sorted(self)})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Each family saved with save_pretrained, and the parameters from_pretrained builds from it."""
    from transformers import AutoModelForCausalLM

    out = Saved()
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        _tiny(kind).save_pretrained(d)
        loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        out[kind] = (d, {n: p.detach().clone() for n, p in loaded.named_parameters()})
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_parameter_reads_as_from_pretrained_builds_it(saved: Any, kind: str) -> None:
    directory, params = saved[kind]
    reader = CheckpointReader(directory)
    stacks = [n for n in params if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacks) == 4 and not set(stacks) & reader.keys()  # stored per expert, not stacked
    for name, want in params.items():
        key = reader.resolve(name)
        assert key is not None, name
        assert reader.shape(key) == tuple(want.shape), name
        assert torch.equal(reader.read(key), want), name
    assert {r["key"] for r in reader.reads} == reader.keys()  # every stored tensor read, by its own name


def _ranges(draw: Any, size: int) -> list[tuple[int, int]]:
    """Disjoint, increasing (start, length) ranges inside [0, size): what a column or expert cut asks for."""
    cuts = sorted(draw(st.sets(st.integers(0, size), min_size=2, max_size=6)))
    pairs = [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]
    keep = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    return [p for p, k in zip(pairs, keep, strict=True) if k] or pairs[:1]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), kind=st.sampled_from(KINDS), layer=st.integers(0, 1),
       which=st.sampled_from(["gate_up_proj", "down_proj"]), dim=st.integers(0, 2))
def test_a_slice_of_a_stack_reads_only_what_it_holds(saved: Any, data: Any, kind: str, layer: int, which: str,
                                                     dim: int) -> None:
    directory, params = saved[kind]
    name = f"model.layers.{layer}.mlp.experts.{which}"
    full = params[name]
    ranges = _ranges(data.draw, full.shape[dim])
    reader = CheckpointReader(directory)
    got = reader.read(reader.resolve(name), dim, ranges)  # type: ignore[arg-type]
    assert torch.equal(got, torch.cat([full.narrow(dim, s, n) for s, n in ranges], dim=dim))
    wanted = {e for s, n in ranges for e in range(s, s + n)} if dim == 0 else set(range(EXPERTS))
    read_experts = {int(r["key"].split(".experts.")[1].split(".")[0]) for r in reader.reads}
    assert read_experts == wanted  # no expert outside the cut is touched
    if dim == 0:
        assert all(r["dim"] is None for r in reader.reads)  # an owned expert is read whole, once per
                                                            # projection
        assert len(reader.reads) == len(wanted) * (2 if which == "gate_up_proj" else 1)
    else:  # only the rows or columns in the cut, of every expert
        assert all(r["dim"] == dim - 1 and sum(n for _,
                                               n in r["ranges"]) <= full.shape[dim] for r in reader.reads)
        parts = 2 if which == "gate_up_proj" and dim == 2 else 1  # a column cut reads it of gate and of up
        assert sum(n for r in reader.reads for _,
                   n in r["ranges"]) == EXPERTS * parts * sum(n for _, n in ranges)


def test_a_missing_expert_is_named(saved: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory, _ = saved["mixtral"]
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reader = CheckpointReader(tmp_path)
    assert reader.resolve("model.layers.0.mlp.experts.gate_up_proj") is not None
    with pytest.raises(PretrainedLoadError, match=r"DSF640: .*lacks expert\(s\) \[2\] of model.layers.1.mlp"):
        reader.resolve("model.layers.1.mlp.experts.gate_up_proj")


@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_what_save_pretrained_writes(saved: Any, kind: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    directory, params = saved[kind]
    want = load_file(str(directory / "model.safetensors"))
    got = on_disk(params, kind)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in got.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    back = dict(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).named_parameters())
    assert all(torch.equal(back[n], p) for n, p in params.items())
    assert on_disk(params, "llama") is params  # a dense family is written as the model holds it
