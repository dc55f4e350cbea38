"""An export's HF directory written by transformers' own ``save_pretrained``: key for key what it writes.

The dense tensors a checkpoint assembles are the parameters of the job's HF model (its own module
names; a tied head once, under the embedding). They are assigned into that model built on the meta
device from the job's config (the `model.pretrained` directory's own config.json, or the spec's), and
the model saves itself: whatever layout transformers writes for the family (one tensor per expert,
renamed blocks, transposed stacks, per its conversion mapping), its tied-weight handling and the
dtypes are transformers', not a table of dsforge's. A persistent buffer the checkpoint does not carry
(DeepSeek-V3's ``e_score_correction_bias``) is read from the `model.pretrained` directory it started from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from dsforge.runtime.errors import RuntimeRefusal


class HfExportError(RuntimeRefusal, RuntimeError):
    """The dense tensors do not fill the job's HF model; the message names what is missing or extra."""


def fill_hf_model(cfg: Any, dense: Mapping[str, Tensor], source: str | Path | None = None) -> Any:
    """The job's HF causal LM holding ``dense`` (and the buffers ``source`` stores), ready for
    save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    # from_config stamps the top-level dtype on every sub-config (phi4_multimodal's audio and vision ones),
    # which the model's own save would write as they were
    subs = {k: getattr(getattr(cfg, k), "dtype", None) for k in getattr(cfg, "sub_configs", {})
            if getattr(cfg, k, None) is not None}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for key, dtype in subs.items():
        getattr(model.config, key).dtype = dtype
    result = model.load_state_dict(dict(dense), strict=False, assign=True)
    if result.unexpected_keys:
        raise HfExportError(f"the saved weights hold tensors the {type(model).__name__} has not: "
                            f"{sorted(result.unexpected_keys)[:4]}")
    model.tie_weights()
    left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left and source is not None:
        from dsforge.runtime.pretrained import CheckpointReader, hf_renamings

        reader = CheckpointReader(source, hf_renamings(model))
        try:
            found = {
                n: reader.read(k)
                for n in left
                if (k := reader.resolve(n, model.base_model_prefix)) is not None
            }
        finally:
            reader.close()
        model.load_state_dict(found, strict=False, assign=True)
        left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left:
        raise HfExportError(f"the saved weights do not fill the {type(model).__name__}: {sorted(left)[:4]} "
                            "(neither trained parameters nor tensors of the model.pretrained directory)")
    return model


def save_hf(target: Path, cfg: Any, dense: Mapping[str, Tensor], source: str | Path | None = None) -> None:
    """config.json, the weights (and generation_config.json where the family has one) as save_pretrained
    writes them."""
    fill_hf_model(cfg, dense, source).save_pretrained(str(target))
