"""DSF040-041 and DSF620-627, DSF629: the user's data (`training.data` of kind text or megatron) can be read
as the job says.

Each check reads as little as it can (the first record of the first file, an .idx header, tokenizer.json
as JSON) and imports neither torch nor numpy nor the optional readers (pyarrow, datasets): a CI job
without them still validates. The runtime (dsforge.runtime.datasets) reads the files through the same
functions (dsforge.compiler.frontend.data_files), so a job that passes here reads the same files there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from dsforge.compiler.frontend.data_files import (
    DataFileError,
    TextFiles,
    needed_package,
    read_idx_header,
    read_tokenizer,
    record_fields,
    text_files,
)
from dsforge.compiler.frontend.job_paths import is_absolute, written_value
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity

DATA = ("training", "data")
PATH = (*DATA, "path")
USER_KINDS = ("text", "megatron")


def _paths(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _user_data(ctx: Context) -> bool:
    return ctx.spec.training.data.kind in USER_KINDS


def _files(ctx: Context, path: str) -> TextFiles | None:
    """The text files of ``path``, or None where DSF620 reports them (missing, empty)."""
    try:
        return text_files(path)
    except DataFileError:
        return None


def _field(ctx: Context) -> str:
    data = ctx.spec.training.data
    return data.field_ or ("messages" if data.format == "chat" else "text")


@rule("DSF040", "the shape of training.data fits its kind", source="dsforge")
def data_shape(ctx: Context) -> Iterator[Finding]:
    """A text corpus is one path (a file, a directory or a glob); several paths blend only megatron datasets,
    one weight per path; chat records are read from text files; a validation set is a path or a fraction."""
    data = ctx.spec.training.data
    paths = _paths(data.path)
    if data.kind == "text" and len(paths) > 1:
        yield Finding(f"training.data.path lists {len(paths)} paths; kind text reads one (a file, a "
                      f"directory or a glob)", "put the files in one directory, or "
                                               "write a glob such as data/*.jsonl", PATH)
    if data.weights and (data.kind != "megatron" or len(data.weights) != len(paths)):
        yield Finding(f"training.data.weights has {len(data.weights)} weights for {len(paths)} "
                      f"{'megatron prefixes' if data.kind == 'megatron' else 'paths of kind ' + data.kind}",
                      "give one weight per megatron prefix in training.data.path (or drop weights)",
                      (*DATA, "weights"))
    if data.format == "chat" and data.kind != "text":
        yield Finding(f"training.data.format chat reads message "
                      f"records from text files, not kind {data.kind}",
                      "set kind: text and point path at the .jsonl/.json/.parquet records", (*DATA, "format"))
    if data.kind in USER_KINDS and not paths:
        yield Finding(f"training.data.kind is {data.kind} but no path is given", "add `path:` to the data",
                      DATA)
    v = data.valid
    if v is not None:
        if data.kind not in USER_KINDS:
            yield Finding(f"training.data.valid needs kind text or megatron, not {data.kind}",
                          "set training.data.kind to text or megatron, or drop valid", (*DATA, "valid"))
        elif (v.path is None) == (v.fraction is None):
            yield Finding("training.data.valid needs exactly one of path (validation files) and fraction (a "
                          "held-out share of the training data)", "set valid.path or valid.fraction",
                          (*DATA, "valid"))


@rule("DSF620", "the data files exist and are not empty", source="dsforge")
def data_files_exist(ctx: Context) -> Iterator[Finding]:
    """A text path must name .jsonl/.json/.parquet/.txt files (or an HF datasets directory) that hold
    something, a megatron prefix its .bin and .idx. A missing absolute path may be a mount of the machines
    that run the job, so it is a warning there (as DSF610's); `dsforge run` refuses it."""
    data = ctx.spec.training.data
    if data.kind not in USER_KINDS:
        return
    keys: list[tuple[tuple[str, ...], str]] = [(PATH, p) for p in _paths(data.path)]
    if data.valid is not None and data.valid.path:
        keys.append(((*DATA, "valid", "path"), data.valid.path))
    for key, path in keys:
        try:
            if data.kind == "megatron" and key == PATH:
                read_idx_header(path)
            elif data.kind == "megatron":
                for prefix in _paths(path):
                    read_idx_header(prefix)
            else:
                text_files(path)
        except DataFileError as exc:
            if exc.rule != "DSF620":
                continue  # DSF625 reports an unreadable index
            written = written_value(ctx.raw, key)
            absent = "does not exist" in exc.message
            remote = absent and isinstance(written, str) and is_absolute(written)
            yield Finding(exc.message + (" on this machine" if remote else ""),
                          exc.fix + ("; if it exists only on the machines that run the job, this warning can "
                                     "be ignored" if remote else ""), key,
                          severity=Severity.WARNING if remote else None)


@rule("DSF621", "the records hold the field the job reads", source="dsforge")
def data_field_present(ctx: Context) -> Iterator[Finding]:
    """`training.data.field` (default text, or messages for chat) must be a key of the records; only the first
    record of the first file is read (a Parquet file's schema, an HF directory's dataset_info.json)."""
    data = ctx.spec.training.data
    if data.kind != "text" or not isinstance(data.path, str):
        return
    files = _files(ctx, data.path)
    if files is None or (
        needed_package(files) and importlib.util.find_spec(needed_package(files) or "") is None
    ):
        return  # DSF620 / DSF626
    key = (*DATA, "field") if ctx.written((*DATA, "field")) else PATH
    try:
        fields = record_fields(files)
    except DataFileError as exc:
        yield Finding(exc.message, exc.fix, key)
        return
    if fields is None:  # .txt: each line is a document
        if data.format == "chat":
            yield Finding(f"{files.files[0]} is plain text; format chat reads message records",
                          "write the conversations as .jsonl records with a messages field",
                          (*DATA, "format"))
        return
    field = _field(ctx)
    if field not in fields:
        where = files.hf or files.files[0]
        yield Finding(f"the first record of {where} has no field {field!r} (it has "
                      f"{', '.join(map(repr, fields))})",
                      f"set training.data.field to the field that holds the "
                      f"{'messages' if data.format == 'chat' else 'text'}",
                      key)


@rule("DSF622", "the tokenizer can be found", source="dsforge")
def tokenizer_found(ctx: Context) -> Iterator[Finding]:
    """Text is tokenized by model.pretrained's tokenizer.json (`tokenizer: auto`) or the one named by path."""
    data = ctx.spec.training.data
    if data.kind != "text":
        return
    try:
        read_tokenizer(data.tokenizer, ctx.spec.model.pretrained)
    except DataFileError as exc:
        yield Finding(exc.message, exc.fix, (*DATA, "tokenizer"))


@rule("DSF623", "the tokenizer's vocabulary fits the model's", source="dsforge")
def tokenizer_vocab_fits(ctx: Context) -> Iterator[Finding]:
    """A token id at or above model.vocab has no embedding row: the first batch that holds one fails."""
    data = ctx.spec.training.data
    if data.kind != "text":
        return
    try:
        tok = read_tokenizer(data.tokenizer, ctx.spec.model.pretrained)
    except DataFileError:
        return
    vocab = ctx.plan.model.vocab
    if tok.vocab > vocab:
        yield Finding(f"the tokenizer {tok.file} has {tok.vocab:,} tokens, more than model.vocab {vocab:,}",
                      f"use the model's own tokenizer, or a model with vocab >= {tok.vocab}",
                      (*DATA, "tokenizer"))


@rule("DSF624", "chat records have a chat template", source="dsforge")
def chat_template_present(ctx: Context) -> Iterator[Finding]:
    """format: chat renders each conversation with the tokenizer's chat template (tokenizer_config.json's
    chat_template or chat_template.jinja); without one the assistant's tokens cannot be found."""
    data = ctx.spec.training.data
    if data.kind != "text" or data.format != "chat":
        return
    try:
        tok = read_tokenizer(data.tokenizer, ctx.spec.model.pretrained)
    except DataFileError:
        return
    if tok.chat_template is None:
        yield Finding(f"training.data.format is chat but {tok.directory} has no chat template",
                      "save the tokenizer with its chat_template (tokenizer_config.json or "
                      "chat_template.jinja), or use format: text", (*DATA, "format"))


@rule("DSF625", "the Megatron index can be read", source="dsforge")
def megatron_index_readable(ctx: Context) -> Iterator[Finding]:
    """dsforge reads MMIDIDX version 1 indexes with integer token types (Megatron-Core's
    indexed_dataset.py)."""
    data = ctx.spec.training.data
    if data.kind != "megatron":
        return
    for prefix in _paths(data.path):
        try:
            read_idx_header(prefix)
        except DataFileError as exc:
            if exc.rule == "DSF625":
                yield Finding(exc.message, exc.fix, PATH)


@rule("DSF626", "the package a data format needs is installed", source="dsforge")
def data_package_installed(ctx: Context) -> Iterator[Finding]:
    """Parquet files are read with pyarrow, an HF datasets directory with datasets (the `data` extra)."""
    data = ctx.spec.training.data
    if data.kind != "text" or not isinstance(data.path, str):
        return
    files = _files(ctx, data.path)
    package = needed_package(files) if files is not None else None
    if package is not None and importlib.util.find_spec(package) is None:
        yield Finding(f"reading {data.path} needs the {package} package, which is not installed",
                      "pip install 'dsforge[data]'", PATH)


@rule("DSF627", "packed documents can be kept apart exactly", source="dsforge")
def document_boundaries_exact(ctx: Context) -> Iterator[Finding]:
    """`packing: true` restarts positions at each document and HF's attention builds the per-document causal
    mask from them. dsforge's pipeline stages and context-parallel attention take no positions, and a
    model.factory module's attention is unknown: there the boundaries cannot be kept, so it is refused
    (`packing: concat` packs with attention across documents, as Megatron does by default)."""
    data = ctx.spec.training.data
    d = ctx.plan.degrees
    if data.kind not in USER_KINDS or d is None:
        return
    if data.packing is not True:
        return
    why = (f"pipeline stages (pp={d.pp}) take no per-document positions" if d.pp > 1
           else f"context-parallel attention (cp={d.cp}) takes no per-document positions" if d.cp > 1
           else "a model.factory module's attention may not follow per-document "
                "positions" if ctx.spec.model.factory
           else None)
    if why:
        yield Finding(f"training.data.packing: true keeps attention within documents, but {why}",
                      "set packing: concat (attention across documents) or packing: false (one document per "
                      "sequence)" + (", or use pp: 1" if d.pp > 1 else ", or use cp: 1" if d.cp > 1 else ""),
                      (*DATA, "packing"))


@rule("DSF629", "the validation loss is computed within the run", severity=Severity.WARNING, source="dsforge")
def validation_within_run(ctx: Context) -> Iterator[Finding]:
    """The validation loss is computed after every `valid.every`-th step; an interval longer than the run
    computes none."""
    t = ctx.spec.training
    v = t.data.valid
    if v is not None and v.every > t.steps:
        yield Finding(f"training.data.valid.every={v.every} exceeds "
                      f"steps={t.steps}: no validation loss is computed",
                      f"use valid.every <= {t.steps}", (*DATA, "valid", "every"))


@rule("DSF041", "the monitor's writers are installed", severity=Severity.WARNING, source="dsforge")
def monitor_installed(ctx: Context) -> Iterator[Finding]:
    """TensorBoard needs the tensorboard package, wandb the wandb package, where the job runs (DeepSpeed's
    monitor imports them at start-up); here only a warning, since the run may use another environment."""
    mon = ctx.spec.training.monitor
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(mon, key) and importlib.util.find_spec(package) is None:
            yield Finding(
                f"training.monitor.{key} is on but {package} is not installed here",
                f"pip install {package}" + (" (or 'dsforge[monitor]')" if package == "tensorboard" else ""),
                ("training", "monitor", key),
            )
