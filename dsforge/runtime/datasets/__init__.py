"""The user's own data as training samples: text/JSONL/JSON/Parquet/HF datasets tokenized by the model's
tokenizer (cached beside the data), Megatron indexed datasets and their blends, chat records with
assistant-only loss.

``text_source`` and ``megatron_source`` return a source for dsforge.runtime.data.Batches: sample i is a pure
function of i and the seed, so every rank reads exactly its share and a resumed run reads on from its step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsforge.runtime.datasets.packing import PackedTokens
from dsforge.runtime.errors import DataError


def _documents(files: Any, field: str | None, fmt: str,
               tokenizer: Any) -> Iterator[tuple[list[int], list[int] | None]]:
    """Every record's ids (EOS appended) and, for chat, its loss mask."""
    from dsforge.runtime.datasets.chat import chat_tokens, check_messages
    from dsforge.runtime.datasets.text_files import records

    batch: list[str] = []

    def flush() -> Iterator[tuple[list[int], list[int] | None]]:
        for ids in tokenizer.encode(batch):
            yield (ids if ids and ids[-1] == tokenizer.eos else [*ids, tokenizer.eos]), None
        batch.clear()

    for where, value in records(files, field):
        if fmt == "chat":
            ids, mask = chat_tokens(tokenizer, check_messages(value, where), where)
            if not ids or ids[-1] != tokenizer.eos:
                ids, mask = [*ids, tokenizer.eos], [*mask, 0]
            yield ids, mask
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: field {field!r} holds a {type(value).__name__}, not text (for "
                            f"messages set training.data.format: chat)")
        batch.append(value)
        if len(batch) >= 512:
            yield from flush()
    if batch:
        yield from flush()


def default_field(data: Any) -> str:
    """The field the records' text (or messages) is read from."""
    return data.field_ or ("messages" if data.format == "chat" else "text")


def text_source(data: Any, path: str, model: Any, seed: int,
                windows: tuple[float, float] = (0.0, 1.0)) -> PackedTokens:
    """Samples of `kind: text` files at ``path``, tokenized by the job's tokenizer through the cache."""
    from dsforge.compiler.frontend.data_files import text_field
    from dsforge.runtime.datasets.text_files import resolve_files
    from dsforge.runtime.datasets.tokenize_cache import cache_key, tokenized
    from dsforge.runtime.datasets.tokenizer import load_tokenizer

    files = resolve_files(path)
    tok = load_tokenizer(data.tokenizer, model.pretrained)
    if tok.vocab > model.vocab:
        raise DataError(f"the tokenizer {tok.files.file} has {tok.vocab} tokens, more than model.vocab "
                        f"{model.vocab} (DSF623)")
    field = text_field(files, data.field_, data.format)
    key = cache_key(files, tok.digest, field, data.format)
    cache = tokenized(path, files, key, _documents(files, field, data.format, tok), path)
    return PackedTokens(cache.tokens, cache.starts, cache.mask, seq_len=model.seq_len, vocab=model.vocab,
                        seed=seed, packing=data.packing, eos=tok.eos, name=path, windows=windows)


def megatron_source(data: Any, paths: list[str], model: Any, seed: int,
                    windows: tuple[float, float] = (0.0, 1.0)) -> Any:
    """Samples of one Megatron indexed dataset, or the weighted blend of several."""
    from dsforge.runtime.datasets.megatron_indexed import Blend, IndexedDataset

    sources = []
    for k, prefix in enumerate(paths):
        ds = IndexedDataset(prefix)
        # packing false: a document's padding needs an EOS; Megatron data has none named, so 0 pads (ignored)
        sources.append(PackedTokens(ds.tokens, ds.starts, None, seq_len=model.seq_len, vocab=model.vocab,
                                    seed=seed + k, packing=data.packing, eos=0, name=prefix, windows=windows))
    if len(sources) == 1:
        return sources[0]
    return Blend(sources, list(data.weights) or [1.0] * len(sources))


def require_document_masks() -> None:
    """`packing: true` needs transformers to build the causal mask per document from the positions."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as exc:
        raise DataError("training.data.packing: true needs transformers >= 4.54, which masks attention per "
                        "packed document; upgrade transformers or set packing: "
                        "concat (attention across documents)") from exc


def paths_of(path: str | list[str] | None) -> list[str]:
    """``training.data.path`` as a list."""
    if path is None:
        return []
    return [path] if isinstance(path, str) else list(path)


def source_for(data: Any, model: Any, seed: int, valid: bool = False) -> Any:
    """The training (or, with ``valid``, the validation) source of a `text` or `megatron` job."""
    windows = (0.0, 1.0)
    paths = paths_of(data.path)
    if valid:
        v = data.valid
        if v.path:
            paths = paths_of(v.path)
        else:
            windows = (1.0 - (v.fraction or 0.0), 1.0)
    elif data.valid is not None and not data.valid.path and data.valid.fraction:
        windows = (0.0, 1.0 - data.valid.fraction)
    if not paths:
        raise DataError(f"training.data.kind is {data.kind} but training.data.path is not set")
    if data.packing is True:
        require_document_masks()
    if data.kind == "text":
        if len(paths) != 1:
            raise DataError("training.data.path of kind text is one path (a file, a directory or a glob)")
        return text_source(data, paths[0], model, seed, windows)
    return megatron_source(data, paths, model, seed, windows)
