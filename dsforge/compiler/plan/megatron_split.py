"""Megatron-Core's pipeline split when the embedding and the loss count as layers
(`parallel.pipeline.account_for_embedding` / `account_for_loss`).

megatron/core/transformer/transformer_block.py get_num_layers_to_build (lines 146-201 at NVIDIA/Megatron-LM
d98e8a6): the layer count grows by one for each of the two, must then divide by pp (and each stage's share
by the virtual stages), and the first model chunk of the first stage (the last of the last stage) builds
one transformer layer fewer; transformer_config.py __post_init__ (lines 2370-2415) raises for the same
splits at start-up, and refuses the two keys together with first/last-stage layer counts or an explicit
layout (lines 2228-2260).
"""

from __future__ import annotations


def accounted_total(layers: int, embedding: bool, loss: bool) -> int:
    """The layer count Megatron-Core divides over the stages: the transformer layers, plus one for each of the
    embedding and the loss that count."""
    return layers + int(embedding) + int(loss)


def accounted_partition(layers: int, pp: int, vp: int, embedding: bool, loss: bool) -> list[int]:
    """Transformer layers per model chunk (pipeline order, chunk j·pp + s of stage s) of that split; [] when
    Megatron-Core refuses it (the total does not divide, or a chunk would build fewer than 0 layers)."""
    total = accounted_total(layers, embedding, loss)
    chunks = pp * vp
    if pp < 1 or vp < 1 or total % pp or (total // pp) % vp:
        return []
    per = [total // chunks] * chunks
    if embedding:
        per[0] -= 1
    if loss:
        per[-1] -= 1
    return per if min(per) >= 0 and sum(per) == layers else []
