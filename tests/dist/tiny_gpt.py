"""A tiny GPT-2-style model for memory measurements, optionally Megatron tensor-parallel over gloo.

Written for the tests (not dsforge's runtime layers): explicit attention (matmul, softmax, dropout,
matmul, as on a CPU without a fused kernel), LayerNorm, GELU MLP, dropout 0.1, learned positions,
an untied LM head (a module of its own, so ZeRO-3 gathers it in its own forward). With a tensor-parallel group the QKV and MLP-up projections are column-parallel and
the output and MLP-down projections row-parallel (Shoeybi et al. 2019, fig. 3): the block input
enters through an identity whose backward all-reduces (`_CopyToTP`) and row outputs are summed by an
all-reduce whose backward is the identity (`_ReduceFromTP`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    vocab: int = 256
    seq_len: int = 64
    dropout: float = 0.1


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class Block(nn.Module):
    """One pre-norm transformer layer; with ``tp`` > 1 it holds 1/tp of the heads and MLP width."""

    def __init__(self, cfg: GPTConfig, tp: int = 1, group: object = None) -> None:
        super().__init__()
        self.cfg, self.tp, self.group = cfg, tp, group
        h = cfg.hidden
        self.local_heads = cfg.heads // tp
        self.ln_1 = nn.LayerNorm(h)
        self.c_attn = nn.Linear(h, 3 * h // tp)
        self.c_proj = nn.Linear(h // tp, h, bias=tp == 1)
        self.ln_2 = nn.LayerNorm(h)
        self.c_fc = nn.Linear(h, cfg.ffn // tp)
        self.mlp_proj = nn.Linear(cfg.ffn // tp, h, bias=tp == 1)
        if tp > 1:  # row-parallel biases are added once, after the all-reduce
            self.proj_bias = nn.Parameter(torch.zeros(h))
            self.mlp_bias = nn.Parameter(torch.zeros(h))
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool)))

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(x, self.group) if self.tp > 1 else x

    def _leave(self, x: torch.Tensor, bias: str) -> torch.Tensor:
        if self.tp == 1:
            return x
        return _ReduceFromTP.apply(x, self.group) + getattr(self, bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.c_attn(self._enter(self.ln_1(x))).chunk(3, dim=-1)
        d = self.cfg.hidden // self.cfg.heads
        q, k, v = (t.reshape(b, s, self.local_heads, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(~self.mask[:s, :s], float("-inf"))
        probs = F.dropout(F.softmax(scores, dim=-1), self.cfg.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return F.dropout(self._leave(self.c_proj(out), "proj_bias"), self.cfg.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        y = self.mlp_proj(F.gelu(self.c_fc(self._enter(self.ln_2(x)))))
        return x + F.dropout(self._leave(y, "mlp_bias"), self.cfg.dropout, self.training)


class TinyGPT(nn.Module):
    """Embedding, blocks, final LayerNorm and an LM head; returns the mean cross-entropy loss.

    ``embed_grad_hook``, when set, is registered on the embedding output: it runs inside backward,
    once every block's gradients exist (the measurements snapshot memory there).
    """

    def __init__(self, cfg: GPTConfig, tp: int = 1, group: object = None, recompute: str = "none") -> None:
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, tp, group) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.embed_grad_hook: object = None

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.wte(idx) + self.wpe(pos), self.cfg.dropout, self.training)
        if self.embed_grad_hook is not None and x.requires_grad:
            x.register_hook(self.embed_grad_hook)
        return x

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.recompute == "full":
                # reentrant checkpoint, as Megatron and deepspeed.checkpointing do: only the input is saved
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.run_blocks(self.embed(idx)), targets)
