"""Export writes what save_pretrained writes, key for key, for dense and MoE families of every checkpoint
layout.

Each family's tiny random model (benchmarks/hf_zoo.py's config, fixed seed) is saved by transformers
and, from its parameters alone (what a checkpoint's slices assemble to: a tied head once), by
dsforge.runtime.export_hf; the two directories hold the same tensor names, shapes, dtypes and bytes, and
``from_pretrained`` of the export gives the model's logits exactly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks.hf_zoo import tiny_config
from dsforge.runtime.export_hf import HfExportError, save_hf

#: Dense families (a tied head among them) and every expert layout on disk: one tensor per expert (mixtral,
#: qwen3_moe, olmoe), granitemoe's input_linear/output_linear, llama4_text's transposed gate_up_proj stack,
#: ernie4_5_moe's moe_statics.e_score_correction_bias.
FAMILIES = ["llama", "olmo2", "gemma3_text", "phi", "starcoder2", "mixtral", "qwen3_moe", "olmoe",
            "granitemoe", "llama4_text", "ernie4_5_moe"]


def tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a directory's safetensors files: dtype, shape and bytes, from the files themselves."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + size])
        for key, v in header.items():
            if key != "__metadata__":
                start, end = v["data_offsets"]
                out[key] = (v["dtype"], tuple(v["shape"]), raw[8 + size + start:8 + size + end])
    return out


def _model(model_type: str, tied: bool, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    cfg.tie_word_embeddings = tied
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_writes_what_save_pretrained_writes(model_type: str, tmp_path: Path) -> None:
    tied, dtype = model_type in ("llama",
                                 "gemma3_text"), torch.bfloat16 if model_type == "mixtral" else torch.float32
    model = _model(model_type, tied, dtype)
    model.save_pretrained(tmp_path / "ref")
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}  # a tied head appears once
    save_hf(tmp_path / "out", model.config, dense)
    want, got = tensors(tmp_path / "ref"), tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]][:4]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (tmp_path / "ref" / "config.json").read_text())
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = []
    for name in ("out", "ref"):  # (model.to(bf16) also rounds the rotary buffer, which from_pretrained keeps
                                 # fp32)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=dtype,
                                                                 attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(back(input_ids=ids).logits)
    assert torch.equal(logits[0], logits[1])
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.equal(logits[0], model(input_ids=ids).logits)


def test_a_parameter_the_weights_lack_is_read_from_the_pretrained_directory_or_refused(
    tmp_path: Path,
) -> None:
    model = _model("llama", False, torch.float32)
    model.save_pretrained(tmp_path / "ref")
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if n != "model.norm.weight"}
    with pytest.raises(HfExportError, match="model.norm.weight"):
        save_hf(tmp_path / "out", model.config, dense)
    save_hf(tmp_path / "out2", model.config, dense, tmp_path / "ref")
    assert tensors(tmp_path / "out2") == tensors(tmp_path / "ref")
    with pytest.raises(HfExportError, match="has not"):
        save_hf(tmp_path / "out3", model.config, {**dense, "model.extra.weight": torch.zeros(2)})
