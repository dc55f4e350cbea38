"""DSF011-DSF016, DSF160-DSF163 and DSF640: a job that starts from `model.pretrained` (an HF model directory).

The loader reports DSF011-DSF015 while it fills `model:` from config.json
(dsforge/compiler/frontend/pretrained.py); the checks below see the filled job. A run never writes into its
input, never pads a checkpoint's vocabulary with rows it has no weights for, and says when it converts the
stored dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from dsforge.compiler.frontend.pretrained import (
    PretrainedError,
    checkpoint_dtype,
    read_config,
    sliding_window,
)
from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.rules.registry import Context, Finding, report_id, rule
from dsforge.diagnostics import Severity

_SRC = "dsforge (HF save_pretrained directory layout: config.json, model.safetensors[.index.json])"
report_id("DSF011", "model.pretrained names a readable HF model directory",
          "The directory must exist and hold a config.json that is a JSON object (at most 4 MiB).", _SRC)
report_id("DSF012", "config.json describes a model dsforge can rewrite exactly",
          "Its model_type must be a family whose modules the rewrite policies place and whose tensors the "
          "runtime reads (llama, mistral, qwen2, gpt2, qwen3, and the MoE families mixtral, qwen2_moe and "
          "qwen3_moe, whose per-expert tensors are read as the stacks transformers builds of them; their "
          "every layer sparse), or a dense causal LM whose transformers classes state a tensor-parallel plan "
          "with an exact placement for every style (placed by that plan under arch: auto; any sliding_window "
          "it states counts as applied; of the MoE types OLMoE, GraniteMoE and Llama 4 text, every layer "
          "sparse), with the shape fields present and nothing the job's model keys cannot "
          "state (a sliding window shorter than model.seq_len, Llama's attention_bias or mlp_bias, which "
          "bias o_proj and the MLP too, Llama's pretraining_tp slicing). head_dim and qwen2's q/k/v biases "
          "are read into model.head_dim and model.qkv_bias.", _SRC)
report_id("DSF013", "stated model keys agree with config.json",
          "A `model:` key written in the job file (or supplied by its preset) that differs from the "
          "checkpoint's config.json would plan one model and load another; both values are named. seq_len "
          "may be shorter than max_position_embeddings (rope), "
          "never longer; a GPT-2 position table fixes it.", _SRC)
report_id("DSF014", "the pretrained directory holds its weights",
          "model.safetensors, a safetensors index whose shards are all present, or a torch state dict "
          "(pytorch_model.bin or its index); only the names are checked, no weight is read.", _SRC)
report_id("DSF015", "a pretrained MoE router trains as dsforge's MoE layers do",
          "dsforge's expert layers (HF's block at ep 1, DeepSpeed's gate under ep > 1) route without noise, "
          "drop no token, and train on the language-model loss alone. A Mixtral or Qwen-MoE config.json with "
          "router_jitter_noise > 0 (random noise on the router's input in training) or output_router_logits "
          "true with a non-zero router_aux_loss_coef (the load-balancing loss added to the loss) would train "
          "another model than HF's under the same config, so it is refused naming the key.",
          "HF MixtralSparseMoeBlock (jitter_noise), MixtralForCausalLM / Qwen2MoeForCausalLM "
          "(router_aux_loss_coef); dsforge/runtime/moe.py")
report_id("DSF640", "the pretrained checkpoint holds every parameter of the model, in its shape",
          "Reported by each rank at start-up (dsforge.runtime.materialize) when model.pretrained's weights "
          "lack a tensor the model built from its config.json has, or hold it in another shape: the rank "
          "stops in one line naming the tensor instead of training from made-up weights (transformers would "
          "initialise them randomly and warn).", _SRC)

CHECKPOINT_DIR = ("training", "checkpoint", "dir")
PRETRAINED = ("model", "pretrained")


def _real(path: str) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def inside(child: str, parent: str) -> bool:
    """True when ``child`` is ``parent`` or lies under it (symlinks resolved)."""
    c, p = _real(child), _real(parent)
    return c == p or p in c.parents


@rule("DSF160", "checkpoints are not written into the pretrained directory", source="dsforge")
def checkpoint_outside_pretrained(ctx: Context) -> Iterator[Finding]:
    """A run writes `latest` and its step directories into `training.checkpoint.dir`; inside the
    pretrained directory it would change the input it loads (and a later `resume: auto` would mistake
    one for the other). The runtime refuses the default directory too when the job directory lies there."""
    pretrained, directory = ctx.spec.model.pretrained, ctx.spec.training.checkpoint.dir
    if not pretrained or not os.path.isabs(os.path.expanduser(directory)):
        return  # a relative directory lies in the job directory, which only compile and run know
    if inside(directory, pretrained):
        what = "is" if _real(directory) == _real(pretrained) else "lies inside"
        yield Finding(
            f"training.checkpoint.dir {directory} {what} model.pretrained {pretrained}: the run would write "
            "its checkpoints into the directory it loads",
            "point training.checkpoint.dir elsewhere (the "
            "default, `checkpoints`, lies in the compiled job directory)",
            CHECKPOINT_DIR,
        )


@rule("DSF161", "a pretrained vocabulary is not padded", source="Megatron-LM make-vocab-size-divisible-by")
def pretrained_vocab_unpadded(ctx: Context) -> Iterator[Finding]:
    """Padding adds embedding and LM-head rows the checkpoint holds no weights for; made up, they
    would change every softmax, so the loaded model would not be the checkpoint's."""
    m, d = ctx.plan.model, ctx.plan.degrees
    if not ctx.spec.model.pretrained or d is None:
        return
    padded = padded_vocab(m, d.tp)
    if padded != m.vocab:
        yield Finding(f"vocab_multiple_of {m.vocab_multiple_of} pads the checkpoint's vocabulary of "
                      f"{m.vocab} to {padded} at tp={d.tp}: the added rows have no pretrained weights",
                      "remove model.vocab_multiple_of", ("model", "vocab_multiple_of"))


@rule("DSF162", "model.pretrained and model.factory are not both set", source="dsforge")
def pretrained_or_factory(ctx: Context) -> Iterator[Finding]:
    """Both build the model: the factory's module has its own parameter names, which the checkpoint's
    tensors need not match, so dsforge would not know which tensor is which parameter."""
    if ctx.spec.model.pretrained and ctx.spec.model.factory:
        yield Finding("model.factory and model.pretrained both build the model", "remove model.factory (the "
                      "pretrained directory's config.json builds it), or load the weights inside the factory",
                      ("model", "factory"))


@rule("DSF016", "a sliding window that covers the sequence is full causal attention", severity=Severity.INFO,
      source="HF sliding-window masks (transformers masking_utils: q - kv < sliding_window); Mistral, "
             "Mixtral, Qwen2 configs")
def pretrained_window_covers_sequence(ctx: Context) -> Iterator[Finding]:
    """A query attends to the last `sliding_window` tokens, itself included; when that is at least
    model.seq_len every token sees the whole causal prefix, so the model trains exactly as with full
    causal attention (and context parallelism may split it). A shorter window is refused (DSF012)."""
    pretrained = ctx.spec.model.pretrained
    if not pretrained:
        return
    try:
        window = sliding_window(read_config(Path(pretrained)))
    except PretrainedError:
        return
    seq_len = ctx.spec.model.seq_len
    if window is not None and window >= seq_len:
        yield Finding(f"the checkpoint's sliding_window {window} covers model.seq_len {seq_len}: every token "
                      "attends to its whole prefix, exactly full causal attention",
                      f"nothing to do; a model.seq_len above {window} would be refused (DSF012)", PRETRAINED)


# fp8: bf16 weights
_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


@rule("DSF163", "the checkpoint's dtype conversion is stated", severity=Severity.INFO, source="dsforge")
def pretrained_dtype_conversion(ctx: Context) -> Iterator[Finding]:
    """Each rank converts the tensors it reads to the job's precision; a conversion that changes the
    values (fp32 to bf16 rounds every weight) should not go unsaid."""
    pretrained = ctx.spec.model.pretrained
    if not pretrained:
        return
    stored = checkpoint_dtype(Path(pretrained))
    want = _PRECISION_DTYPES[ctx.spec.training.precision]
    if stored is not None and stored != want:
        rounds = " (rounding every weight)" if _narrower(want, stored) else " (exact)"
        yield Finding(f"the checkpoint is stored in {stored}; each rank converts its slices to {want} for "
                      f"training.precision {ctx.spec.training.precision}{rounds}",
                      "set training.precision to the checkpoint's dtype to train on the stored values",
                      PRETRAINED)


def _narrower(want: str, stored: str) -> bool:
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}
    return bits.get(want, 32) < bits.get(stored, 32) or {want, stored} == {"bfloat16", "float16"}
