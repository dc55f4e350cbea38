"""Fixtures of the user-data tests: a tiny BPE tokenizer trained here, a tiny Llama saved beside it, corpora.

The tokenizer is trained with `tokenizers` on the test corpus (no download) and saved as an HF tokenizer
directory (tokenizer.json, tokenizer_config.json with its EOS and a ChatML-style chat template), next to a
tiny random Llama written with save_pretrained whose vocabulary is the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "all that glitters is not gold",
    "to be or not to be that is the question",
    "the early bird catches the worm",
    "actions speak louder than words",
    "practice makes perfect and patience pays",
    "knowledge is power and time is money",
]
#: ChatML, as Qwen's tokenizers write it (each turn: <|im_start|>role\ncontent<|im_end|>\n).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
                 "endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(out: Path, vocab: int = 320) -> Path:
    """A byte-level BPE tokenizer of at most ``vocab`` tokens trained on SENTENCES, saved under ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4 + ["user assistant system hello thanks"], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}), encoding="utf-8")
    return out


def save_tiny_llama(out: Path, vocab: int) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) with ``vocab`` tokens, saved with its tokenizer beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(7)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=vocab, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def pretrained_with_tokenizer(tmp: Path) -> Path:
    """A model directory holding the tiny Llama and its tokenizer (what `tokenizer: auto` reads)."""
    from tokenizers import Tokenizer

    directory = train_tokenizer(tmp / "model")
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    return save_tiny_llama(directory, vocab)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    """``records`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def corpus(n: int = 48) -> list[dict[str, Any]]:
    """``n`` text records cycling over SENTENCES, with an id field the text field sits beside."""
    return [{"id": i, "text": SENTENCES[i % len(SENTENCES)] + f" number {i % 5}"} for i in range(n)]
