"""DSF1xx: the model's shape against tensor, context and expert parallelism."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors, next_multiple
from dsforge.diagnostics import Severity

SHOEYBI = "Shoeybi et al. 2019 (Megatron-LM) sec. 3"


@rule("DSF121", "hidden is a multiple of heads", source="Vaswani et al. 2017 (head_dim = hidden / heads)",
      reads=())
def hidden_by_heads(ctx: Context) -> Iterator[Finding]:
    """Each attention head has hidden/heads channels; a remainder leaves channels no head owns (with a stated
    model.head_dim too: transformers' Llama and Mixtral configs refuse such a hidden size)."""
    m = ctx.plan.model
    if m.hidden % m.heads:
        yield Finding(f"hidden={m.hidden} is not a multiple of heads={m.heads}",
                      f"use heads in {choices(divisors(m.hidden, 256))}", ("model", "heads"))


@rule("DSF122", "heads is a multiple of kv_heads", source="Ainslie et al. 2023 (GQA)", reads=())
def heads_by_kv(ctx: Context) -> Iterator[Finding]:
    """Grouped-query attention shares each KV head among heads/kv_heads query heads."""
    m = ctx.plan.model
    kv = m.kv_heads
    if m.heads % kv:
        yield Finding(f"heads={m.heads} is not a multiple of kv_heads={kv}",
                      f"use kv_heads in {choices(divisors(m.heads))}", ("model", "kv_heads"))


@rule("DSF103", "tp divides heads", source=SHOEYBI, reads=("tp",))
def tp_divides_heads(ctx: Context) -> Iterator[Finding]:
    """Tensor parallelism splits attention by heads; each rank must own whole query heads."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is not None and m.heads % d.tp:
        yield Finding(f"tp={d.tp} does not divide heads={m.heads}: "
                      f"each tensor-parallel rank must own whole heads",
                      f"use tp in {choices(divisors(m.heads, 64))}", ("parallel", "tp"))


@rule("DSF104", "tp divides kv_heads, or KV replication is stated", source=SHOEYBI + "; Ainslie et al. 2023",
      reads=("tp",))
def tp_divides_kv_heads(ctx: Context) -> Iterator[Finding]:
    """Each tensor-parallel rank must own whole KV heads. With tp > kv_heads the KV heads can instead be
    replicated (tp a multiple of kv_heads), which `parallel.replicate_kv_heads: true` states explicitly;
    DeepSpeed's AutoTP would otherwise split them unevenly with only a log warning. The fix offers the
    replication only to a stack that runs it: dsforge's own runtime refuses it (DSF143)."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    kv = m.kv_heads
    if d is None or kv % d.tp == 0:
        return
    if par.replicate_kv_heads and d.tp % kv == 0:
        return
    fix = f"use tp in {choices(divisors(kv))}, or set kv_heads to a multiple of {d.tp}"
    # dsforge's own runtime cannot build replicated K/V projections (DSF143): offer them to other stacks only
    if d.tp % kv == 0 and getattr(ctx.spec, "stack", "dsforge") != "dsforge":
        fix += ", or set parallel.replicate_kv_heads: true"
    yield Finding(f"tp={d.tp} does not divide kv_heads={kv}: each "
                  f"tensor-parallel rank must own whole KV heads",
                  fix, ("parallel", "tp"))


@rule("DSF105", "tp divides ffn_hidden (and the expert FFN)", source=SHOEYBI, reads=("tp",))
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
                          f"use tp in {choices(divisors(size, 64))}, or {name}={next_multiple(size, d.tp)}",
                          path)


@rule("DSF106", "tp divides vocab, or vocabulary padding is stated", source="Megatron-LM "
      "megatron/training/tokenizer (make-vocab-size-divisible-by); " + SHOEYBI, reads=("tp",))
def tp_divides_vocab(ctx: Context) -> Iterator[Finding]:
    """The embedding and LM head are split by vocabulary rows over tp ranks; with a vocabulary that tp
    does not divide, pad it (`model.vocab_multiple_of`) as Megatron does."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is None or padded_vocab(m, d.tp) % d.tp == 0:
        return
    yield Finding(f"tp={d.tp} does not divide vocab={m.vocab}: the "
                  f"vocabulary-parallel embedding needs equal shards",
                  f"set model.vocab_multiple_of: 128 (pads to {next_multiple(m.vocab, 128 * d.tp)}), "
                  f"or use tp in {choices(divisors(m.vocab, 64))}", ("model", "vocab"))


@rule("DSF107", "vocab is a multiple of 8", severity=Severity.INFO,
      source="deepspeed/runtime/config.py _do_warning_check (vocabulary_size)", reads=())
def vocab_multiple_of_8(ctx: Context) -> Iterator[Finding]:
    """Tensor cores run the embedding and LM-head matmuls fastest with dimensions in multiples of 8;
    DeepSpeed logs the same warning."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if d is not None and padded_vocab(m, d.tp) % 8:
        yield Finding(f"vocab={padded_vocab(m, d.tp)} is not a multiple of 8: LM-head matmuls run slower",
                      "set model.vocab_multiple_of: 8 (or 128)", ("model", "vocab"))


@rule("DSF111", "cp splits the sequence into 2 x cp load-balanced chunks",
      source="Liu et al. 2023 (Ring Attention); Megatron-LM "
             "context parallelism (load-balanced causal chunks)",
      reads=("tp", "cp", "cp_kind", "sequence_parallel"))
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
                      f"{choices([c for c in divisors(m.seq_len // 2, 64) if c > 1] or [1])}",
                      ("parallel", "cp"))


@rule("DSF112", "Ulysses needs heads divisible by tp x cp, and whole or replicated KV heads",
      source="Jacobs et al. 2023 (DeepSpeed-Ulysses); deepspeed/sequence/layer.py _generate_layout_params; "
      "deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF.__init__",
      reads=("tp", "cp", "cp_kind"))
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
                      f"use cp in {choices(divisors(local))}, or context_parallel.kind: ring",
                      ("parallel", "cp"))
    kv = m.kv_heads
    if kv % d.tp == 0:
        local_kv = kv // d.tp
        if local_kv % d.cp and d.cp % local_kv:
            yield Finding(f"Ulysses splits the {local_kv} KV head(s) of each tp rank "
                          f"(kv_heads={kv}/tp={d.tp}) over cp={d.cp}: cp must "
                          f"divide them, or be a multiple of them to replicate them",
                          f"use cp in "
                          f"{choices(sorted(set(divisors(local_kv)) | {local_kv * 2, local_kv * 4}))}",
                          ("parallel", "cp"))
    if m.seq_len % d.cp:
        yield Finding(f"seq_len={m.seq_len} is not divisible by cp={d.cp}: "
                      f"Ulysses gives each rank seq_len/cp tokens",
                      f"use seq_len={next_multiple(m.seq_len, d.cp)}", ("model", "seq_len"))


@rule("DSF123", "sequence parallelism needs seq_len divisible by tp",
      source="Korthikanti et al. 2022 sec. 4.2.2", reads=("tp", "cp", "sequence_parallel"))
def sp_divides_sequence(ctx: Context) -> Iterator[Finding]:
    """Sequence parallelism scatters each sequence over the tensor-parallel ranks in the norm regions."""
    d, m, par = ctx.plan.degrees, ctx.plan.model, ctx.spec.parallel
    if d is None or not par.sequence_parallel or d.tp == 1:
        return
    local = m.seq_len // d.cp if d.cp > 0 else m.seq_len
    if local % d.tp:
        yield Finding(f"sequence parallelism splits seq_len/cp = {local} "
                      f"over tp={d.tp}, which does not divide it",
                      f"use seq_len={next_multiple(m.seq_len, d.tp * d.cp)}", ("model", "seq_len"))


@rule("DSF116", "MoE routing fits: top_k <= experts, every <= layers, a top-1 Mixtral has ep 1",
      source="Shazeer et al. 2017; deepspeed/moe/sharded_moe.py TopKGate.forward (top1/top2/topkgating)",
      reads=("ep",))
def moe_top_k(ctx: Context) -> Iterator[Finding]:
    """A token cannot be routed to more experts than exist; an MoE interval longer than the model makes no
    layer an MoE layer. DeepSpeed 0.19.8's gate routes any top-k (top1gating, top2gating, and topkgating
    for k > 2, which renormalise over the k chosen), but its top-1 weighs the expert by its probability
    where Mixtral's renormalised top-1 weighs it by 1, so a top-1 Mixtral has no expert-parallel twin."""
    moe = ctx.spec.model.moe
    if moe is None:
        return
    d = ctx.plan.degrees
    if moe.top_k > moe.experts:
        yield Finding(f"moe.top_k={moe.top_k} exceeds moe.experts={moe.experts}",
                      f"use top_k <= {moe.experts}", ("model", "moe", "top_k"))
    elif moe.top_k == 1 and ctx.spec.model.arch == "mixtral" and d is not None and d.ep > 1:
        yield Finding(f"moe.top_k=1 with ep={d.ep}: DeepSpeed's top-1 gate weighs the expert by its softmax "
                      "probability, a Mixtral top-1 router by 1", "use ep: 1, or top_k >= 2",
                      ("model", "moe", "top_k"))
    if moe.every > ctx.spec.model.layers:
        yield Finding(f"moe.every={moe.every} exceeds layers={ctx.spec.model.layers}: no layer would be MoE",
                      f"use every <= {ctx.spec.model.layers}", ("model", "moe", "every"))


# DeepSpeed 0.19.8's MoE gate (deepspeed/moe/sharded_moe.py TopKGate.forward): top1gating for k = 1 (the
# expert weighted by its softmax probability), top2gating for k = 2 and topkgating for any k > 2 (both
# renormalise the k weights); drop_tokens=False sizes every expert's capacity to the busiest one (dropless).
MOE_SOURCE = "deepspeed/moe/sharded_moe.py TopKGate.forward, top1gating/top2gating/topkgating"

#: Families whose HF MoE block has a shared expert (Qwen2-MoE: one, gated; DeepSeek-V3: n_shared_experts).
SHARED_EXPERT_FAMILIES = ("qwen2_moe", "deepseek_v3")
#: MoE families without one.
ROUTED_ONLY_FAMILIES = ("mixtral", "qwen3_moe")
#: Families whose sequence-parallel regions (dsforge.runtime.rewrite.sequence) were checked against the
#: forward.
SEQUENCE_PARALLEL_FAMILIES = ("gpt2", "llama", "mixtral")


@rule("DSF150", "dropping tokens over capacity needs expert parallelism", source=MOE_SOURCE, reads=("ep",))
def drop_tokens_needs_ep(ctx: Context) -> Iterator[Finding]:
    """With ep = 1 the model's own HF MoE block routes every token to its experts (dropless); only
    DeepSpeed's gate, which dsforge runs for ep > 1, drops the tokens over an expert's capacity."""
    moe, d = ctx.spec.model.moe, ctx.plan.degrees
    if moe is not None and moe.drop_tokens and d is not None and d.ep == 1:
        yield Finding("moe.drop_tokens: true with ep=1: the model's own MoE block never drops tokens, so the "
                      "job would run dropless",
                      "set moe.drop_tokens: false, or use ep > 1 (DeepSpeed's gate)",
                      ("model", "moe", "drop_tokens"))


@rule("DSF151", "capacity_factor takes effect only when tokens are dropped", severity=Severity.WARNING,
      source=MOE_SOURCE, reads=())
def capacity_unused(ctx: Context) -> Iterator[Finding]:
    """Dropless routing (drop_tokens: false) gives every expert the capacity of the busiest one, so a
    capacity_factor the job sets changes nothing that runs."""
    moe = ctx.spec.model.moe
    if moe is not None and not moe.drop_tokens and ctx.written(("model", "moe", "capacity_factor")):
        yield Finding(f"moe.capacity_factor={moe.capacity_factor} has no effect: routing is dropless "
                      "(drop_tokens: false) and every expert takes all of its tokens",
                      "set moe.drop_tokens: true (and ep > 1) to cap each expert, or remove capacity_factor",
                      ("model", "moe", "capacity_factor"))


@rule("DSF152", "DeepSeek-V3's router has no expert-parallel twin in DeepSpeed", source=MOE_SOURCE,
      reads=("ep",))
def deepseek_router(ctx: Context) -> Iterator[Finding]:
    """DeepSeek-V3 scores experts with a sigmoid plus a load-balancing bias and picks the top-k within the
    best expert groups; DeepSpeed's gate is a softmax top-k, so the expert-parallel layer would route
    differently. With ep = 1 the model's own block routes (exact)."""
    d = ctx.plan.degrees
    if ctx.spec.model.arch == "deepseek_v3" and d is not None and d.ep > 1:
        yield Finding(f"ep={d.ep} for a DeepSeek-V3 model: its sigmoid, group-limited router has no exact "
                      f"twin in DeepSpeed's softmax top-k gate",
                      "use ep: 1 (spread the experts' memory with zero: 3)", ("parallel", "ep"))


@rule("DSF153", "MLA attention is replicated on every tensor-parallel rank", severity=Severity.WARNING,
      source="dsforge/compiler/model/rewrite_policies.py DEEPSEEK_V3", reads=())
def mla_replicated(ctx: Context) -> Iterator[Finding]:
    """MLA (DeepSeek-V3) compresses keys and values into one low-rank latent shared by all heads, plus one
    rotary key shared by every head; the policy keeps the attention whole on every TP rank, which is exact
    but divides neither its weights nor its activations by tp (the estimates assume they are)."""
    d = ctx.plan.degrees
    if ctx.spec.model.arch == "deepseek_v3" and d is not None and d.tp > 1:
        yield Finding(f"tp={d.tp}: MLA attention runs whole on each of the {d.tp} ranks (exact; only the "
                      f"MLPs and the vocabulary are split), so its memory is tp times the estimate's",
                      "prefer tp: 1 with zero: 3 or pp for MLA models", ("parallel", "tp"))


@rule("DSF154", "sequence parallelism is implemented for gpt2, llama and mixtral",
      source="dsforge/runtime/rewrite/sequence.py wrap_sequence_parallel", reads=("tp", "sequence_parallel"),
      stacks=DSFORGE_RUNTIME)
def sequence_parallel_family(ctx: Context) -> Iterator[Finding]:
    """The sequence-parallel regions wrap each decoder block's attention and MLP; they were checked against
    the GPT-2, Llama (Mistral, Qwen2) and Mixtral forwards only, so other families refuse it."""
    d, arch = ctx.plan.degrees, ctx.spec.model.arch
    if (ctx.spec.parallel.sequence_parallel is True and d is not None and d.tp > 1
            and arch not in (*SEQUENCE_PARALLEL_FAMILIES, "auto", "custom")):
        yield Finding(f"sequence_parallel with model.arch {arch}: dsforge's sequence-parallel regions exist "
                      f"for {', '.join(SEQUENCE_PARALLEL_FAMILIES)} only",
                      "set parallel.sequence_parallel: false", ("parallel", "sequence_parallel"))


@rule("DSF155", "moe.shared_experts matches the family", source="HF Qwen2MoeSparseMoeBlock, DeepseekV3MoE",
      reads=())
def shared_experts_family(ctx: Context) -> Iterator[Finding]:
    """Qwen2-MoE and DeepSeek-V3 pass every token through shared experts beside the routed ones; Mixtral
    and Qwen3-MoE have none. The count decides the parameters and FLOPs explain reports."""
    moe, arch = ctx.spec.model.moe, ctx.spec.model.arch
    if moe is None:
        return
    if arch in ROUTED_ONLY_FAMILIES and moe.shared_experts:
        yield Finding(f"moe.shared_experts={moe.shared_experts}, but a {arch} MoE block has no shared expert",
                      "set moe.shared_experts: 0", ("model", "moe", "shared_experts"))
    elif arch in SHARED_EXPERT_FAMILIES and not moe.shared_experts:
        yield Finding(f"moe.shared_experts=0, but every {arch} MoE block has a shared expert",
                      "set moe.shared_experts (and moe.shared_ffn_hidden) to the model's",
                      ("model", "moe", "shared_experts"))


# The Gemma2-under-cp check at validate (refused whatever its config) is retired: soft-capping is in the
# model's config, which only the built module shows; DSF144 refuses it at compile from the meta-built model,
# with sliding windows and dropout, and lets a Gemma2 without them (attn_logit_softcapping null) through.
