"""DSF1xx: the model's shape against tensor, context and expert parallelism."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.params import padded_vocab
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors, next_multiple
from dsforge.diagnostics import Severity

SHOEYBI = "Shoeybi et al. 2019 (Megatron-LM) sec. 3"


@rule("DSF121", "hidden is a multiple of heads", source="Vaswani et al. 2017 (head_dim = hidden / heads)")
def hidden_by_heads(ctx: Context) -> Iterator[Finding]:
    """Each attention head has hidden/heads channels; a remainder leaves channels no head owns."""
    m = ctx.plan.model
    if m.hidden % m.heads:
        yield Finding(f"hidden={m.hidden} is not a multiple of heads={m.heads}",
                      f"use heads in {choices(divisors(m.hidden, 256))}", ("model", "heads"))


@rule("DSF122", "heads is a multiple of kv_heads", source="Ainslie et al. 2023 (GQA)")
def heads_by_kv(ctx: Context) -> Iterator[Finding]:
    """Grouped-query attention shares each KV head among heads/kv_heads query heads."""
    m = ctx.plan.model
    kv = m.kv_heads
    if m.heads % kv:
        yield Finding(f"heads={m.heads} is not a multiple of kv_heads={kv}",
                      f"use kv_heads in {choices(divisors(m.heads))}", ("model", "kv_heads"))


@rule("DSF103", "tp divides heads", source=SHOEYBI)
def tp_divides_heads(ctx: Context) -> Iterator[Finding]:
    """Tensor parallelism splits attention by heads; each rank must own whole query heads."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is not None and m.heads % d.tp:
        yield Finding(f"tp={d.tp} does not divide heads={m.heads}: each tensor-parallel rank must own whole heads",
                      f"use tp in {choices(divisors(m.heads, 64))}", ("parallel", "tp"))


@rule("DSF104", "tp divides kv_heads, or KV replication is stated", source=SHOEYBI + "; Ainslie et al. 2023")
def tp_divides_kv_heads(ctx: Context) -> Iterator[Finding]:
    """Each tensor-parallel rank must own whole KV heads. With tp > kv_heads the KV heads can instead be
    replicated (tp a multiple of kv_heads), which `parallel.replicate_kv_heads: true` states explicitly;
    DeepSpeed's AutoTP would otherwise split them unevenly with only a log warning."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    kv = m.kv_heads
    if d is None or kv % d.tp == 0:
        return
    if par.replicate_kv_heads and d.tp % kv == 0:
        return
    fix = f"use tp in {choices(divisors(kv))}, or set kv_heads to a multiple of {d.tp}"
    if d.tp % kv == 0:
        fix += ", or set parallel.replicate_kv_heads: true"
    yield Finding(f"tp={d.tp} does not divide kv_heads={kv}: each tensor-parallel rank must own whole KV heads",
                  fix, ("parallel", "tp"))


@rule("DSF105", "tp divides ffn_hidden (and the expert FFN)", source=SHOEYBI)
def tp_divides_ffn(ctx: Context) -> Iterator[Finding]:
    """The MLP's first matrix is split by columns and the second by rows over tp ranks."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is None:
        return
    sizes: list[tuple[str, int, tuple[str, ...]]] = [("ffn_hidden", m.ffn_hidden, ("model", "ffn_hidden"))]
    if m.moe is not None:
        sizes.append(("moe.ffn_hidden", m.moe.ffn_hidden, ("model", "moe", "ffn_hidden")))
    for name, size, path in sizes:
        if size % d.tp:
            yield Finding(f"tp={d.tp} does not divide {name}={size}",
                          f"use tp in {choices(divisors(size, 64))}, or {name}={next_multiple(size, d.tp)}", path)


@rule("DSF106", "tp divides vocab, or vocabulary padding is stated", source="Megatron-LM "
      "megatron/training/tokenizer (make-vocab-size-divisible-by); " + SHOEYBI)
def tp_divides_vocab(ctx: Context) -> Iterator[Finding]:
    """The embedding and LM head are split by vocabulary rows over tp ranks; with a vocabulary that tp
    does not divide, pad it (`model.vocab_multiple_of`) as Megatron does."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is None or padded_vocab(m, d.tp) % d.tp == 0:
        return
    yield Finding(f"tp={d.tp} does not divide vocab={m.vocab}: the vocabulary-parallel embedding needs equal shards",
                  f"set model.vocab_multiple_of: 128 (pads to {next_multiple(m.vocab, 128 * d.tp)}), "
                  f"or use tp in {choices(divisors(m.vocab, 64))}", ("model", "vocab"))


@rule("DSF107", "vocab is a multiple of 8", severity=Severity.INFO,
      source="deepspeed/runtime/config.py _do_warning_check (vocabulary_size)")
def vocab_multiple_of_8(ctx: Context) -> Iterator[Finding]:
    """Tensor cores run the embedding and LM-head matmuls fastest with dimensions in multiples of 8;
    DeepSpeed logs the same warning."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is not None and padded_vocab(m, d.tp) % 8:
        yield Finding(f"vocab={padded_vocab(m, d.tp)} is not a multiple of 8: LM-head matmuls run slower",
                      "set model.vocab_multiple_of: 8 (or 128)", ("model", "vocab"))


@rule("DSF111", "cp splits the sequence into 2 x cp load-balanced chunks",
      source="Liu et al. 2023 (Ring Attention); Megatron-LM context parallelism (load-balanced causal chunks)")
def cp_divides_sequence(ctx: Context) -> Iterator[Finding]:
    """Ring context parallelism under a causal mask cuts the sequence into 2 x cp chunks and gives rank i
    chunks i and 2cp-1-i so every rank does equal work; seq_len must divide into those chunks (and by tp
    again when sequence parallelism splits each chunk)."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    if d is None or d.cp == 1 or par.context_parallel.kind != "ring":
        return
    step = 2 * d.cp * (d.tp if par.sequence_parallel else 1)
    if m.seq_len % step:
        yield Finding(f"seq_len={m.seq_len} does not split into {step} equal chunks (2*cp"
                      + ("*tp" if par.sequence_parallel else "") + ")",
                      f"use seq_len={next_multiple(m.seq_len, step)}, or cp in "
                      f"{choices([c for c in divisors(m.seq_len // 2, 64) if c > 1] or [1])}", ("parallel", "cp"))


@rule("DSF112", "Ulysses needs heads divisible by tp x cp, and whole or replicated KV heads",
      source="Jacobs et al. 2023 (DeepSpeed-Ulysses); deepspeed/sequence/layer.py _generate_layout_params; "
      "deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF.__init__")
def ulysses_heads(ctx: Context) -> Iterator[Finding]:
    """Ulysses swaps the sequence split for a head split with an all-to-all, so every context-parallel
    rank of a tensor-parallel shard needs whole query heads (heads divisible by tp x cp). KV heads may
    instead be replicated when cp is a multiple of the local KV-head count, as DeepSpeed's HF adapter
    allows; and the sequence must split evenly over cp (DeepSpeed does not assert this in
    DistributedAttention and silently computes wrong attention otherwise, issue #7384)."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    if d is None or d.cp == 1 or par.context_parallel.kind != "ulysses":
        return
    if m.heads % (d.tp * d.cp):
        local = m.heads // d.tp if m.heads % d.tp == 0 else 1
        yield Finding(f"Ulysses needs heads={m.heads} divisible by tp*cp = {d.tp}*{d.cp} = {d.tp * d.cp}",
                      f"use cp in {choices(divisors(local))}, or context_parallel.kind: ring", ("parallel", "cp"))
    kv = m.kv_heads
    if kv % d.tp == 0:
        local_kv = kv // d.tp
        if local_kv % d.cp and d.cp % local_kv:
            yield Finding(f"Ulysses splits the {local_kv} KV head(s) of each tp rank (kv_heads={kv}/tp={d.tp}) "
                          f"over cp={d.cp}: cp must divide them, or be a multiple of them to replicate them",
                          f"use cp in {choices(sorted(set(divisors(local_kv)) | {local_kv * 2, local_kv * 4}))}",
                          ("parallel", "cp"))
    if m.seq_len % d.cp:
        yield Finding(f"seq_len={m.seq_len} is not divisible by cp={d.cp}: Ulysses gives each rank seq_len/cp tokens",
                      f"use seq_len={next_multiple(m.seq_len, d.cp)}", ("model", "seq_len"))


@rule("DSF123", "sequence parallelism needs seq_len divisible by tp", source="Korthikanti et al. 2022 sec. 4.2.2")
def sp_divides_sequence(ctx: Context) -> Iterator[Finding]:
    """Sequence parallelism scatters each sequence over the tensor-parallel ranks in the norm regions."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    if d is None or not par.sequence_parallel or d.tp == 1:
        return
    local = m.seq_len // d.cp if d.cp > 0 else m.seq_len
    if local % d.tp:
        yield Finding(f"sequence parallelism splits seq_len/cp = {local} over tp={d.tp}, which does not divide it",
                      f"use seq_len={next_multiple(m.seq_len, d.tp * d.cp)}", ("model", "seq_len"))


@rule("DSF116", "MoE routing fits: top_k <= experts, every <= layers",
      source="Shazeer et al. 2017; deepspeed/moe/layer.py MoE.__init__ (k in {1, 2})")
def moe_top_k(ctx: Context) -> Iterator[Finding]:
    """A token cannot be routed to more experts than exist, and DeepSpeed's native MoE gate implements
    only top-1 and top-2 routing; an MoE interval longer than the model makes no layer an MoE layer."""
    moe = ctx.spec.model.moe
    if moe is None:
        return
    if moe.top_k > moe.experts:
        yield Finding(f"moe.top_k={moe.top_k} exceeds moe.experts={moe.experts}",
                      f"use top_k <= {moe.experts}", ("model", "moe", "top_k"))
    elif moe.top_k > 2:
        yield Finding(f"moe.top_k={moe.top_k}: DeepSpeed's native MoE gate implements only top-1 and top-2",
                      "use top_k 1 or 2", ("model", "moe", "top_k"), Severity.WARNING)
    if moe.every > ctx.spec.model.layers:
        yield Finding(f"moe.every={moe.every} exceeds layers={ctx.spec.model.layers}: no layer would be MoE",
                      f"use every <= {ctx.spec.model.layers}", ("model", "moe", "every"))
