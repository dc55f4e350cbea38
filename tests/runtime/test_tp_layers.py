"""Tensor-parallel layers (tp 2) against the very dense modules they were sharded from.

Each check builds a dense module and input with the same seed on every rank (the single-process
reference), shards that module with ``from_dense``, and compares outputs, input gradients and
weight gradients with the matching slices of the reference. A failure means the layer's forward
communication or its conjugate backward (Megatron's f/g pairs) is wrong for that block.

Tolerance: rtol 1e-5 of the reference's largest magnitude. fp32 rounds at 6e-8 relative; sharding
re-associates sums of at most 64 products (the all-reduce adds two partial sums), so the worst-case
deviation is about 64 x 6e-8 = 4e-6 of the terms' scale. A real bug (a missing all-reduce, a wrong
shard) errs by O(1) of that scale.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsforge.compiler.plan.placement import place
from dsforge.runtime.groups import ParallelGroups, create_groups
from dsforge.runtime.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    allreduce_sequence_parallel_grads,
    gather_from_sequence,
    mark_sequence_parallel,
    scatter_to_sequence,
    vocab_parallel_cross_entropy,
)
from tests.runtime.launcher import report, run

RTOL = 1e-5
B, S, H = 2, 6, 16


def _shard(t: torch.Tensor, rank: int, tp: int, dim: int) -> torch.Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def _blocks(t: torch.Tensor, widths: list[int], rank: int, tp: int, dim: int) -> torch.Tensor:
    """This rank's slice of every fused block of ``t`` along ``dim`` ([q_r | k_r | v_r])."""
    return torch.cat([_shard(b, rank, tp, dim) for b in t.split(widths, dim=dim)], dim=dim)


def _column_fused_gqa(g: ParallelGroups) -> None:
    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(1)
    widths = [16, 8, 8]  # q: 4 heads of 4, k and v: 2 KV heads of 4 (GQA)
    dense = nn.Linear(H, sum(widths))
    x = torch.randn(B, S, H, requires_grad=True)
    w_out = torch.randn(B, S, sum(widths))
    ref = dense(x)
    (ref * w_out).sum().backward()
    for gather in (False, True):
        col = ColumnParallelLinear.from_dense(dense, g, blocks=widths, unit=4, gather_output=gather)
        xp = x.detach().clone().requires_grad_(True)
        y = col(xp)
        if gather:  # output replicated: every rank's loss is the whole loss
            report("column(gather,gqa) out", y, ref, RTOL)
            (y * w_out).sum().backward()
        else:  # output split: the loss is the sum of the ranks' local terms
            report("column(gqa) out", y, _blocks(ref, widths, r, tp, -1), RTOL)
            (y * _blocks(w_out, widths, r, tp, -1)).sum().backward()
        report(f"column(gather={gather}) dx", xp.grad, x.grad, RTOL)
        report(f"column(gather={gather}) dW", col.weight.grad, _blocks(dense.weight.grad, widths, r, tp, 0),
               RTOL)
        report(f"column(gather={gather}) db", col.bias.grad, _blocks(dense.bias.grad, widths, r, tp, 0), RTOL)


def _gpt2_conv1d(g: ParallelGroups) -> None:
    """HF GPT-2's Conv1D (weight stored (in, out)): fused c_attn as 3 column blocks, c_proj as a row layer."""
    from transformers.pytorch_utils import Conv1D

    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(8)
    c_attn, c_proj = Conv1D(3 * H, H), Conv1D(H, H)
    with torch.no_grad():
        for p in (*c_attn.parameters(), *c_proj.parameters()):
            p.normal_(0.0, 0.2)  # HF initialises biases to zero; non-zero ones test their sharding too
    x = torch.randn(B, S, H, requires_grad=True)
    ref = c_proj(c_attn(x)[..., :H])  # the query block only: an output that depends on the block order
    ref.square().sum().backward()
    col = ColumnParallelLinear.from_dense(c_attn, g, blocks=3)
    row = RowParallelLinear.from_dense(c_proj, g)
    xp = x.detach().clone().requires_grad_(True)
    y = row(col(xp)[..., :H // tp])  # this rank's query shard is the first of its three local blocks
    report("gpt2 conv1d c_attn->c_proj out", y, ref, RTOL)
    y.square().sum().backward()
    report("gpt2 conv1d dx", xp.grad, x.grad, RTOL)
    report("gpt2 conv1d d c_attn.W", col.weight.grad, _blocks(c_attn.weight.grad.t(), [H] * 3, r, tp, 0),
           RTOL)
    report("gpt2 conv1d d c_proj.W", row.weight.grad, _shard(c_proj.weight.grad.t(), r, tp, 1), RTOL)


def _row(g: ParallelGroups) -> None:
    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(2)
    dense = nn.Linear(24, H)
    x = torch.randn(B, S, 24, requires_grad=True)
    w_out = torch.randn(B, S, H)
    ref = dense(x)
    (ref * w_out).sum().backward()
    for parallel_input in (True, False):
        row = RowParallelLinear.from_dense(dense, g, input_is_parallel=parallel_input)
        xp = (_shard(x.detach(), r, tp, -1) if parallel_input else x.detach()).clone().requires_grad_(True)
        y = row(xp)
        report(f"row(parallel_in={parallel_input}) out", y, ref, RTOL)
        (y * w_out).sum().backward()
        report(f"row(parallel_in={parallel_input}) dx", xp.grad,
               _shard(x.grad, r, tp, -1) if parallel_input else x.grad, RTOL)
        report("row dW", row.weight.grad, _shard(dense.weight.grad, r, tp, 1), RTOL)
        report("row db", row.bias.grad, dense.bias.grad, RTOL)


def _mlp_with_sequence_parallel(g: ParallelGroups) -> None:
    """LayerNorm -> column -> GELU -> row, plain TP and with sequence parallelism (Korthikanti et al.
    2022)."""
    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(3)
    norm, up, down = nn.LayerNorm(H), nn.Linear(H, 32), nn.Linear(32, H)
    with torch.no_grad():  # non-trivial norm parameters so their gradients mean something
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(B, S, H, requires_grad=True)
    w_out = torch.randn(B, S, H)
    ref = down(F.gelu(up(norm(x))))
    (ref * w_out).sum().backward()
    for sp in (False, True):
        pnorm = nn.LayerNorm(H)
        pnorm.load_state_dict(norm.state_dict())
        if sp:
            for p in pnorm.parameters():
                mark_sequence_parallel(p)
        col = ColumnParallelLinear.from_dense(up, g, sequence_parallel=sp)
        row = RowParallelLinear.from_dense(down, g, sequence_parallel=sp)
        xp = (_shard(x.detach(), r, tp, 1) if sp else x.detach()).clone().requires_grad_(True)
        y = row(F.gelu(col(pnorm(xp))))
        want, w = (_shard(ref, r, tp, 1), _shard(w_out, r, tp, 1)) if sp else (ref, w_out)
        report(f"mlp(sp={sp}) out", y, want, RTOL)
        (y * w).sum().backward()
        allreduce_sequence_parallel_grads([*pnorm.parameters(), *row.parameters()], g.tp)
        report(f"mlp(sp={sp}) dx", xp.grad, _shard(x.grad, r, tp, 1) if sp else x.grad, RTOL)
        report(f"mlp(sp={sp}) d up.W", col.weight.grad, _shard(up.weight.grad, r, tp, 0), RTOL)
        report(f"mlp(sp={sp}) d down.W", row.weight.grad, _shard(down.weight.grad, r, tp, 1), RTOL)
        report(f"mlp(sp={sp}) d down.b", row.bias.grad, down.bias.grad, RTOL)
        report(f"mlp(sp={sp}) d norm.w", pnorm.weight.grad, norm.weight.grad, RTOL)
        report(f"mlp(sp={sp}) d norm.b", pnorm.bias.grad, norm.bias.grad, RTOL)


def _sequence_mappings(g: ParallelGroups) -> None:
    """scatter/gather along the sequence are inverse, and their backwards carry the right gradients."""
    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(4)
    x = torch.randn(B, S, H, requires_grad=True)
    local = scatter_to_sequence(x, g.tp, dim=1)
    report("scatter_to_sequence", local, _shard(x, r, tp, 1), 0.0)
    full = gather_from_sequence(local, g.tp, dim=1, grad_is_partial=False)
    report("gather_from_sequence", full, x, 0.0)
    w = torch.randn(B, S, H)
    (full * w).sum().backward()  # replicated consumer: d/dx is w, through split then gather
    report("scatter/gather backward", x.grad, w, 0.0)


def _vocab(g: ParallelGroups, vocab: int) -> None:
    """Embedding -> LM head -> cross entropy over an uneven vocabulary split, untied and tied, with and
    without SP."""
    r, tp = g.index("tp"), g.size("tp")
    torch.manual_seed(5)
    emb, head = nn.Embedding(vocab, H), nn.Linear(H, vocab, bias=False)
    ids = torch.randint(0, vocab, (B, S))
    target = torch.randint(0, vocab, (B, S))
    target[0, :2] = -100  # ignored tokens must give zero loss and zero gradient
    for tied in (False, True):
        if tied:
            head.weight = emb.weight
        emb.zero_grad()
        head.zero_grad()
        logits = head(emb(ids))
        ref = F.cross_entropy(logits.view(-1, vocab), target.view(-1), reduction="none").view(B, S)
        (ref.sum() / (target != -100).sum()).backward()
        for sp in (False, True):
            pemb = VocabParallelEmbedding.from_dense(emb, g, sequence_parallel=sp)
            phead = VocabParallelLMHead.from_dense(head, g, sequence_parallel=sp)
            if tied:
                phead.tie_to(pemb)
            hidden = pemb(ids)
            if sp:
                report("embedding(sp) out", hidden, _shard(emb(ids), r, tp, 1), RTOL)
            local_logits = phead(hidden)
            report("lm head local logits", local_logits, logits[..., phead.vocab_start:phead.vocab_end], RTOL)
            loss = vocab_parallel_cross_entropy(local_logits, target, g.tp, phead.vocab_start)
            report(f"vocab CE(tied={tied}, sp={sp}) loss", loss, ref, RTOL)
            (loss.sum() / (target != -100).sum()).backward()
            rows = slice(pemb.vocab_start, pemb.vocab_end)
            report(f"embedding dW(tied={tied}, sp={sp})", pemb.weight.grad, emb.weight.grad[rows], RTOL)
            if not tied:
                report(f"lm head dW(sp={sp})", phead.weight.grad, head.weight.grad[rows], RTOL)


def _lm_head_gather(g: ParallelGroups, vocab: int) -> None:
    torch.manual_seed(6)
    head = nn.Linear(H, vocab, bias=False)
    h = torch.randn(B, S, H, requires_grad=True)
    ref = head(h)
    w = torch.randn(B, S, vocab)
    (ref * w).sum().backward()
    phead = VocabParallelLMHead.from_dense(head, g, gather_output=True)
    hp = h.detach().clone().requires_grad_(True)
    out = phead(hp)
    report("lm head gathered logits (uneven split)", out, ref, RTOL)
    (out * w).sum().backward()
    report("lm head gathered dx", hp.grad, h.grad, RTOL)


def _lm_head_bias(g: ParallelGroups, vocab: int) -> None:
    """A biased LM head (CodeGen, GPT-J, Phi): each rank keeps its rows of the bias; logits and both grads
    match."""
    torch.manual_seed(7)
    head = nn.Linear(H, vocab, bias=True)
    h = torch.randn(B, S, H, requires_grad=True)
    w = torch.randn(B, S, vocab)
    ref = head(h)
    (ref * w).sum().backward()
    phead = VocabParallelLMHead.from_dense(head, g)
    rows = slice(phead.vocab_start, phead.vocab_end)
    assert phead.bias is not None
    hp = h.detach().clone().requires_grad_(True)
    out = phead(hp)
    report("biased lm head local logits", out, ref[..., rows], RTOL)
    (out * w[..., rows]).sum().backward()
    report("biased lm head dW", phead.weight.grad, head.weight.grad[rows], RTOL)
    report("biased lm head db", phead.bias.grad, head.bias.grad[rows], RTOL)
    report("biased lm head dx", hp.grad, h.grad, RTOL)


def _tp2_worker(rank: int, world: int, with_transformers: bool) -> None:
    g = create_groups(place(tp=2, pp=1, dp=1, cp=1, ep=1, gpus_per_node=2))
    assert g.size("tp") == 2
    _column_fused_gqa(g)
    _row(g)
    if with_transformers:
        _gpt2_conv1d(g)
    _mlp_with_sequence_parallel(g)
    _sequence_mappings(g)
    _vocab(g, vocab=37)  # 37 rows: 19 on rank 0, 18 on rank 1
    _lm_head_gather(g, vocab=37)
    _lm_head_bias(g, vocab=37)


@pytest.mark.slow
def test_tensor_parallel_layers_match_dense_tp2() -> None:
    with_transformers = importlib.util.find_spec("transformers") is not None
    if not with_transformers:
        warnings.warn("transformers is not installed: the HF Conv1D (GPT-2) sharding check is not run",
                      stacklevel=1)
    run(_tp2_worker, 2, with_transformers)
