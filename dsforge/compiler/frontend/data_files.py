"""The user's data files as validate sees them: which files a `training.data.path` names, the first record's
keys, the tokenizer's vocabulary and chat template, a Megatron `.idx` header (torch- and numpy-free).

The runtime reads the same files through these functions (dsforge.runtime.datasets), so validate and the
run agree on what `path` means. Everything here is cheap: only the first record of a file is parsed, only the
header of an `.idx`.
"""

from __future__ import annotations

import glob
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: File suffixes `kind: text` reads (the HF datasets directory is recognised by its own files).
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
#: Files `datasets.Dataset.save_to_disk` writes next to its Arrow shards (DatasetDict: dataset_dict.json).
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")

#: Megatron-Core's MMIDIDX index (megatron/core/datasets/indexed_dataset.py, `_INDEX_HEADER` and
#: `_IndexWriter`): 9 magic bytes, version u64 (1), dtype code u8, sequence count u64, document count u64,
#: then the arrays.
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
#: Megatron's DType codes (megatron/core/datasets/indexed_dataset.py, class DType) of integer token types.
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
MEGATRON_ITEMSIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2}


class DataFileError(ValueError):
    """A data file cannot be used as the job says; ``rule`` is the diagnostic id, ``fix`` what to do."""

    def __init__(self, rule: str, message: str, fix: str) -> None:
        super().__init__(message)
        self.rule, self.message, self.fix = rule, message, fix


@dataclass(frozen=True)
class TextFiles:
    """What a `kind: text` path names: plain files in order, or one HF datasets directory (``hf``)."""

    files: tuple[Path, ...]
    hf: Path | None = None


def is_hf_dataset(directory: Path) -> bool:
    """True for a directory `datasets.Dataset.save_to_disk` (or DatasetDict's) wrote."""
    return directory.is_dir() and any((directory / m).is_file() for m in HF_MARKERS)


def text_files(path: str) -> TextFiles:
    """The files of ``path`` (a file, a directory of them, a glob, or an HF datasets directory), sorted by
    name."""
    target = Path(path).expanduser()
    if is_hf_dataset(target):
        return TextFiles((), target)
    if target.is_dir():
        found = sorted(p for p in target.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(target).parts))
        where = f"directory {target}"
    elif target.is_file():
        found, where = [target], str(target)
    elif glob.has_magic(str(target)):
        found = sorted(Path(p) for p in glob.glob(str(target), recursive=True) if Path(p).is_file())
        where = f"glob {path}"
    else:
        raise DataFileError("DSF620", f"training.data.path {path} does not exist",
                            "create the file or correct training.data.path (a relative path is taken from "
                            "the job file's directory)")
    odd = [p for p in found if p.suffix not in TEXT_SUFFIXES]
    if odd:
        raise DataFileError("DSF620", f"{odd[0]} is not a {', '.join(TEXT_SUFFIXES)} file",
                            "point training.data.path at .jsonl, .json, .parquet or .txt files")
    if not found:
        raise DataFileError("DSF620", f"the {where} holds no {', '.join(TEXT_SUFFIXES)} file",
                            "point training.data.path at the data files (or a glob such as data/*.jsonl)")
    empty = next((p for p in found if p.stat().st_size == 0), None)
    if empty is not None:
        raise DataFileError("DSF620", f"{empty} is empty", "remove the empty file or point "
                                                            "training.data.path at files that hold records")
    return TextFiles(tuple(found))


def needed_package(files: TextFiles) -> str | None:
    """The optional package reading these files needs (pyarrow for Parquet, datasets for an HF directory)."""
    if files.hf is not None:
        return "datasets"
    return "pyarrow" if any(p.suffix == ".parquet" for p in files.files) else None


def first_record(path: Path) -> Any:
    """The first record of a .jsonl, .json or .txt file (a .txt file's first line is its record)."""
    if path.suffix == ".txt":
        with path.open(encoding="utf-8", errors="replace") as fh:
            return fh.readline()
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        return json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataFileError("DSF621", f"{path}:{number}: not a JSON record ({exc.msg})",
                                            "write one JSON object per line") from exc
        raise DataFileError("DSF620", f"{path} holds no record", "add records or remove the file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataFileError("DSF621", f"{path}: not JSON ({exc})", "write a JSON list of records") from exc
    if not isinstance(data, list) or not data:
        raise DataFileError("DSF621", f"{path} is not a non-empty JSON list of records",
                            "write a JSON list of objects, or use .jsonl (one object per line)")
    return data[0]


def record_fields(files: TextFiles) -> list[str] | None:
    """The field names of the first record (None for .txt files, whose records are lines)."""
    if files.hf is not None:
        return hf_columns(files.hf)
    first = files.files[0]
    if first.suffix == ".txt":
        return None
    if first.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for Parquet: an optional dependency (the `data` extra)

        return list(pq.read_schema(first).names)
    record = first_record(first)
    if not isinstance(record, dict):
        raise DataFileError("DSF621",
                            f"{first}: the first record is a {type(record).__name__}, not an object",
                            "write records as JSON objects with the text in a field")
    return list(record)


def hf_columns(directory: Path) -> list[str]:
    """Column names of an HF datasets directory, from its dataset_info.json (a DatasetDict: its train
    split)."""
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        split = "train" if "train" in splits else (splits[0] if splits else "")
        directory = directory / split
    try:
        info = json.loads((directory / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataFileError("DSF621", f"{directory}: cannot read dataset_info.json ({exc})",
                            "point training.data.path at a directory written by "
                            "Dataset.save_to_disk") from exc
    features = info.get("features")
    return list(features) if isinstance(features, dict) else []


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer on disk: its tokenizer.json, the directory around it, its vocabulary and chat template."""

    file: Path
    directory: Path
    vocab: int  # one more than the largest token id (base vocabulary and added tokens)
    chat_template: str | None


def tokenizer_location(tokenizer: str, pretrained: str | None) -> Path:
    """The tokenizer.json the job means: model.pretrained's (``auto``), or the directory or file named."""
    if tokenizer == "auto":
        if not pretrained:
            raise DataFileError("DSF622", "training.data.tokenizer is auto but model.pretrained is not set",
                                "set training.data.tokenizer to a tokenizer "
                                "directory (or its tokenizer.json)")
        base = Path(pretrained).expanduser()
    else:
        base = Path(tokenizer).expanduser()
    file = base / "tokenizer.json" if base.is_dir() or not base.suffix else base
    if not file.is_file():
        key = "model.pretrained" if tokenizer == "auto" else "training.data.tokenizer"
        raise DataFileError("DSF622", f"no tokenizer.json at {file} ({key})",
                            "save the tokenizer next to the model (tokenizer.save_pretrained) or set "
                            "training.data.tokenizer to its directory")
    return file


def read_tokenizer(tokenizer: str, pretrained: str | None) -> TokenizerFiles:
    """The tokenizer's files and facts, read with json only (no `tokenizers` import)."""
    file = tokenizer_location(tokenizer, pretrained)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens",
                                          []) if isinstance(t, dict) and isinstance(t.get("id"), int)]
        size = max((i for i in ids if isinstance(i, int)), default=-1) + 1
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise DataFileError("DSF622", f"{file} is not a tokenizer.json ({exc})",
                            "point training.data.tokenizer at a directory saved by "
                            "tokenizer.save_pretrained") from exc
    return TokenizerFiles(file, file.parent, size, chat_template(file.parent))


def chat_template(directory: Path) -> str | None:
    """The chat template saved beside the tokenizer (chat_template.jinja or tokenizer_config.json's), or
    None."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # several named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return template if isinstance(template, str) and template else None


@dataclass(frozen=True)
class IdxHeader:
    """The fixed part of a Megatron .idx file, and where its arrays begin."""

    dtype: str
    sequences: int
    documents: int
    offset: int  # bytes before the sequence-length array


def read_idx_header(prefix: str) -> IdxHeader:
    """The header of ``prefix``.idx, checked against the .bin's size; DataFileError (DSF625/DSF620) when
    unusable."""
    idx, binf = Path(prefix + ".idx").expanduser(), Path(prefix + ".bin").expanduser()
    for f in (idx, binf):
        if not f.is_file():
            raise DataFileError("DSF620", f"{f} does not exist (training.data.path "
                                          f"is the prefix of .bin/.idx)",
                                "write the path without .bin/.idx, e.g. data/corpus_text_document")
    fixed = len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8
    with idx.open("rb") as fh:
        head = fh.read(fixed)
    fix = "write it with Megatron's tools/preprocess_data.py (MMIDIDX version 1)"
    if len(head) < fixed or head[:len(MEGATRON_MAGIC)] != MEGATRON_MAGIC:
        raise DataFileError("DSF625", f"{idx} is not a Megatron MMIDIDX index (its magic bytes differ)", fix)
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MEGATRON_MAGIC):])
    if version != MEGATRON_VERSION:
        raise DataFileError("DSF625", f"{idx} is index version {version}; "
                                      f"dsforge reads version {MEGATRON_VERSION}",
                            fix)
    if code not in MEGATRON_DTYPES:
        raise DataFileError("DSF625", f"{idx} stores tokens as dtype code {code}, not an integer type "
                                      f"dsforge reads "
                                      f"({', '.join(f'{c}={n}' for c, n in MEGATRON_DTYPES.items())})", fix)
    need = fixed + sequences * (4 + 8) + documents * 8
    if idx.stat().st_size < need:
        raise DataFileError("DSF625", f"{idx} is {idx.stat().st_size} bytes, shorter than the {need} its "
                                      f"header announces ({sequences} sequences, "
                                      f"{documents} document indices)", fix)
    if sequences == 0:
        raise DataFileError("DSF620", f"{idx} holds no sequence", "preprocess a non-empty corpus")
    return IdxHeader(MEGATRON_DTYPES[code], sequences, documents, fixed)


# --- the tokenization cache's key, and what explain says about a corpus
# -----------------------------------------
#: Version of the cache layout (dsforge.runtime.datasets.tokenize_cache); part of every key.
CACHE_FORMAT = 1
CACHE_DIR = ".dsforge-cache"
#: Bytes of text explain reads to find a corpus's cache (its key hashes the files' content): ~1 s of hashing.
EXPLAIN_HASH_LIMIT = 1 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


def tokenizer_digest(tok: TokenizerFiles) -> str:
    """A hash of every file that changes what the tokenizer (and its chat template) produces."""
    import hashlib

    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = tok.directory / name if name != "tokenizer.json" else tok.file
        if f.is_file():
            digest.update(name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


#: Environment variable naming a directory for the tokenization caches instead of beside the data (read-only
#: data directories); the key is the same, so any directory is safe.
CACHE_ENV = "DSFORGE_DATA_CACHE"


def cache_root(path: str, files: TextFiles) -> Path:
    """The directory the cache goes into: beside the data (the file's directory, the directory, the glob's
    fixed part, or the HF datasets directory), or $DSFORGE_DATA_CACHE where it is set."""
    import os

    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if files.hf is not None:
        return files.hf
    target = Path(path).expanduser()
    if target.is_dir():
        return target
    if target.is_file():
        return target.parent
    fixed = Path(path.split("*")[0].split("?")[0].split("[")[0])
    return fixed if fixed.is_dir() else fixed.parent


def cache_key(files: TextFiles, tokenizer_hash: str, field: str | None, fmt: str) -> str:
    """The hash naming a cache: format version, tokenizer, field, format and every data file's content."""
    import hashlib

    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{tokenizer_hash}\0{field}\0{fmt}\0".encode())
    data = sorted(p for p in files.hf.rglob("*") if p.is_file() and CACHE_DIR not in p.parts) \
        if files.hf is not None else list(files.files)
    for path in data:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:24]


def text_field(files: TextFiles, field: str | None, fmt: str) -> str | None:
    """The field records are read from (None for .txt files, whose lines are the documents)."""
    if files.hf is None and all(p.suffix == ".txt" for p in files.files):
        return None
    return field or ("messages" if fmt == "chat" else "text")


@dataclass(frozen=True)
class Corpus:
    """What explain says about a corpus: its tokens and documents (None before it was tokenized) and where."""

    name: str
    tokens: int | None
    documents: int | None
    note: str


def idx_sizes_total(prefix: str) -> tuple[int, int]:
    """(tokens, documents) of a Megatron dataset, summed from its .idx sequence lengths."""
    import array

    header = read_idx_header(prefix)
    with open(Path(prefix + ".idx").expanduser(), "rb") as fh:
        fh.seek(header.offset)
        sizes = array.array("i")
        sizes.frombytes(fh.read(4 * header.sequences))
    if sys.byteorder != "little":
        sizes.byteswap()
    return sum(sizes), max(header.documents - 1, 1)


def corpora(data: Any, pretrained: str | None) -> list[Corpus]:
    """The training corpora of a `text` or `megatron` job, with their token counts where known."""
    out = []
    paths = [data.path] if isinstance(data.path, str) else list(data.path or [])
    for path in paths:
        if data.kind == "megatron":
            tokens, docs = idx_sizes_total(path)
            out.append(Corpus(path, tokens, docs, "from the .idx"))
            continue
        files = text_files(path)
        size = sum(p.stat().st_size for p in files.files) if files.hf is None else \
            sum(p.stat().st_size for p in files.hf.rglob("*.arrow"))
        if size > EXPLAIN_HASH_LIMIT:  # finding the cache means hashing every byte: not for a quick explain
            out.append(Corpus(path, None, None, f"not counted ({size:,} bytes; explain hashes at most "
                                                f"{EXPLAIN_HASH_LIMIT:,} to find the tokenization cache)"))
            continue
        tok = read_tokenizer(data.tokenizer, pretrained)
        key = cache_key(files, tokenizer_digest(tok), text_field(files, data.field_, data.format),
                        data.format)
        meta = cache_root(path, files) / CACHE_DIR / key / "meta.json"
        if meta.is_file():
            info = json.loads(meta.read_text(encoding="utf-8"))
            out.append(Corpus(path, int(info["tokens"]), int(info["documents"]),
                              f"tokenized, cached in {meta.parent}"))
        else:
            out.append(Corpus(path, None, None, f"not tokenized yet ({size:,} bytes); `dsforge run` "
                                                f"tokenizes it once and explain then counts its tokens"))
    return out


def data_summary(spec: Any) -> dict[str, Any] | None:
    """Tokens of the corpus and the epochs `training.steps` makes over it (None for synthetic and token
    files)."""
    t, m = spec.training, spec.model
    data = t.data
    if data.kind not in ("text", "megatron"):
        return None
    try:
        found = corpora(data, m.pretrained)
    except DataFileError as exc:
        return {"error": exc.message}
    share = 1.0 - (data.valid.fraction or 0.0) if data.valid is not None and not data.valid.path else 1.0
    samples_needed = t.steps * t.global_batch
    weights = list(data.weights) or [1.0] * len(found)
    total_w = sum(weights) or 1.0
    rows = []
    for c, w in zip(found, weights):
        row: dict[str, Any] = {"path": c.name, "tokens": c.tokens, "documents": c.documents, "note": c.note}
        if c.tokens is not None and c.documents is not None:
            per_epoch = int(
                ((c.tokens - 1) // m.seq_len if data.packing is not False else c.documents) * share
            )
            row["samples_per_epoch"] = per_epoch
            row["epochs"] = samples_needed * (w / total_w) / per_epoch if per_epoch else None
        rows.append(row)
    return {"kind": data.kind, "packing": data.packing, "samples": samples_needed,
            "train_tokens": samples_needed * m.seq_len, "corpora": rows}
