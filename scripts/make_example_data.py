"""Write examples/data/: a tiny tokenizer for tests/fixtures/pretrained/tiny-llama (128 tokens), text and chat
corpora, and two Megatron indexed datasets, so the README's "Train on your data" runs as written.

    python scripts/make_example_data.py     # rewrites examples/data/ (deterministic)

The tokenizer is a BPE trained here with `tokenizers` (no download); the Megatron files follow the MMIDIDX
layout of Megatron-Core's megatron/core/datasets/indexed_dataset.py (header, version 1, dtype code 8 =
uint16, sequence and document counts, int32 lengths, int64 byte pointers, int64 document indices).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"
WORDS = ("the quick brown fox jumps over the lazy dog a journey of a thousand miles begins with a single "
         "step all that glitters is not gold to be or not to be that is the question").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
                 "endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sentences(n: int, shift: int = 0) -> list[str]:
    return [" ".join(WORDS[(i * 7 + k + shift) % len(WORDS)] for k in range(6 + i % 5)) for i in range(n)]


def main() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    OUT.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>",
                                                                 "<|im_end|>"])
    tok.train_from_iterator(sentences(200) + ["user assistant"] * 4, trainer)
    (OUT / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(OUT / "tokenizer" / "tokenizer.json"))
    (OUT / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
         "chat_template": CHAT_TEMPLATE}, indent=1) + "\n", encoding="utf-8")
    write = lambda name, rows: (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows),
                                                       encoding="utf-8")
    write("train.jsonl", [{"id": i, "text": s} for i, s in enumerate(sentences(120))])
    write("valid.jsonl", [{"id": i, "text": s} for i, s in enumerate(sentences(16, shift=3))])
    write("chat.jsonl", [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
                         for a, b in zip(sentences(40), sentences(40, shift=5))])
    for k, name in enumerate(("books_text_document", "web_text_document")):
        docs = [tok.encode(s).ids + [1] for s in sentences(60, shift=11 * k)]  # EOD (<|endoftext|>) appended
        (OUT / f"{name}.bin").write_bytes(b"".join(struct.pack(f"<{len(d)}H", *d) for d in docs))
        sizes = [len(d) for d in docs]
        pointers = [2 * sum(sizes[:i]) for i in range(len(docs))]
        (OUT / f"{name}.idx").write_bytes(
            b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1)
            + struct.pack(f"<{len(docs)}i", *sizes) + struct.pack(f"<{len(docs)}q", *pointers)
            + struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


if __name__ == "__main__":
    main()
