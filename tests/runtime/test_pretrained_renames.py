"""The checkpoint reader offers the model's names for the keys transformers renames on load (its conversion
mapping's WeightRenaming entries): Exaone saves `transformer.h.N.mlp.c_fc_0`, GPT-NeoX `embed_out`."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch

from benchmarks.hf_zoo import tiny_config
from dsforge.runtime.pretrained import CheckpointReader, hf_renamings


@pytest.mark.parametrize(("model_type", "name", "stored"), [
    ("exaone", "model.layers.1.mlp.gate_proj.weight", "transformer.h.1.mlp.c_fc_0.weight"),
    ("gpt_neox", "lm_head.weight", "embed_out.weight")])
def test_a_renamed_key_is_read_by_the_models_name(tmp_path: Path, model_type: str, name: str,
                                                  stored: str) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
    model.save_pretrained(tmp_path)
    plain = CheckpointReader(tmp_path)
    assert stored in set(plain.keys()) and plain.resolve(name) is None  # what failed as DSF640 before
    plain.close()
    reader = CheckpointReader(tmp_path, hf_renamings(model))
    try:
        key = reader.resolve(name)
        assert key is not None
        assert torch.equal(reader.read(key), model.state_dict()[name])
        assert reader.reads[-1]["key"] == stored  # recorded under the checkpoint's own name
    finally:
        reader.close()


def test_a_tensor_transformers_converts_on_load_is_named_when_missing(tmp_path: Path) -> None:
    """HRM-text's checkpoint fuses q, k, v and a gate (attn.gqkv_proj), which transformers chunks on load; the
    reader cannot, and says so instead of 'written for another model'."""
    from dsforge.runtime.materialize import PretrainedWeights
    from dsforge.runtime.pretrained import PretrainedLoadError, hf_converters

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("hrm_text"))
    model.save_pretrained(tmp_path)
    name = "model.L_module.layers.0.self_attn.q_proj.weight"
    reader = CheckpointReader(tmp_path, hf_renamings(model), hf_converters(model))
    try:
        with pytest.raises(PretrainedLoadError, match=r"gqkv_proj\.weight \(Chunk, its conversion mapping"):
            PretrainedWeights(reader).values(name, tuple(model.state_dict()[name].shape), None, None)
    finally:
        reader.close()
