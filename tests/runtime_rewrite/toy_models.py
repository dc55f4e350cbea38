"""A small non-HF transformer for `arch: custom` tests, loaded through `model.factory`."""

from __future__ import annotations

import torch
from torch import nn

from dsforge.compiler.model.resolved import ResolvedModel


class Expert(nn.Module):
    """One expert MLP."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(hidden, ffn)
        self.w_out = nn.Linear(ffn, hidden)


class Block(nn.Module):
    """Fused-QKV attention projections, an MLP, and (optionally) a list of experts with a router."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        if experts:
            self.router = nn.Linear(hidden, experts, bias=False)
            self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(experts))


class Toy(nn.Module):
    """Embedding, a list of blocks, a final norm and an untied head."""

    def __init__(self, spec: ResolvedModel) -> None:
        super().__init__()
        experts = spec.moe.experts if spec.moe else 0
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec.hidden, spec.ffn_hidden, experts)
                                    for _ in range(spec.layers))
        self.final = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)


def build(spec: ResolvedModel) -> nn.Module:
    """Factory taking the job's model (defaults filled)."""
    return Toy(spec)


def build_llama() -> nn.Module:
    """Factory without arguments returning an HF Llama (for `arch: auto` on a factory model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def not_a_module() -> object:
    """Factory returning the wrong thing."""
    return torch.zeros(2)


def broken() -> nn.Module:
    """Factory that fails."""
    raise RuntimeError("weights not found")
