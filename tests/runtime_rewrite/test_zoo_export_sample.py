"""The CI sample of the zoo's export round trip (benchmarks/hf_zoo.py --mode export): a tiny model saved by
save_pretrained, read back at tp=2 (ep=2 x dp=2) by each rank's slices, gathered and exported by dsforge,
holds save_pretrained's tensors byte for byte and transformers' config. The types are those whose reads
failed before the zoo's export mode found them, plus a stacked-expert layout under ep."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

#: (type, layout, why it is here)
SAMPLE = [("gemma3_text", {"tp": 2}, "a vocab-parallel embedding's embed_scale buffer on a rank skeleton"),
          ("gemma2", {"tp": 2}, "a class that takes no sdpa attention (built eager)"),
          ("llama4_text", {"tp": 2}, "a transposed expert stack [E, hidden, 2F] read at tp=2"),
          ("qwen3_moe", {"ep": 2, "dp": 2}, "one tensor per expert on disk, each rank reading its experts")]


@pytest.mark.slow
def test_the_sample_round_trips_byte_for_byte(tmp_path: Path) -> None:
    import torch

    import benchmarks.hf_zoo as zoo
    from benchmarks.zoo_export import differences, job_file, worker
    from tests.runtime.launcher import run

    jobs = []
    for model_type, degrees, _ in SAMPLE:
        home = tmp_path / model_type
        torch.manual_seed(0)
        zoo._factory(model_type)().save_pretrained(home / "pre")
        jobs.append((str(job_file(home, "job", home / "pre", degrees)), str(home / "out")))
    run(worker, 2, jobs)
    for model_type, _, why in SAMPLE:
        home = tmp_path / model_type
        assert differences(home / "pre", home / "out") == [], (model_type, why)


def test_a_slice_that_is_not_from_pretrained_s_is_named(tmp_path: Path) -> None:
    import torch
    from torch import nn

    import benchmarks.hf_zoo as zoo
    from benchmarks.zoo_export import _wrong_slices
    from dsforge.runtime.weights_io import SliceTag, tag

    torch.manual_seed(0)
    dense = zoo._factory("llama")()
    dense.save_pretrained(tmp_path)
    rows = dense.model.embed_tokens.weight.detach()[64:].clone()
    down = dense.model.layers[0].mlp.down_proj.weight.detach()[:, :48].t().clone()
    held = nn.Module()
    held.rows, held.down = nn.Parameter(rows), nn.Parameter(down)
    tag(held.rows, SliceTag("model.embed_tokens.weight", (128, 64), 0, ((64, 64),)))
    tag(held.down, SliceTag("model.layers.0.mlp.down_proj.weight", (64, 96), 1, ((0, 48),), transpose=True))
    assert _wrong_slices(held, tmp_path) == []
    with torch.no_grad():
        held.down[3, 5] += 1e-6
    assert _wrong_slices(held, tmp_path) == [("model.layers.0.mlp.down_proj.weight[(0, 48)]: not "
                                              "from_pretrained's values")]
