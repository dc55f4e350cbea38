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
