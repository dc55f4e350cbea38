"""The records of `kind: text` data: .jsonl, .json, .parquet and .txt files, or an HF datasets directory.

Records come in file order (files sorted by name), each file's in its own order; the field the job names
holds a document's text (or, for format: chat, its list of messages). A .txt file holds one document per
non-empty line, as the `text` loader of HF datasets reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.data_files import DataFileError, TextFiles, needed_package, text_files
from dsforge.runtime.errors import DataError


def resolve_files(path: str) -> TextFiles:
    """The files of ``path``, with the optional package they need checked; DataError when unusable."""
    try:
        files = text_files(path)
    except DataFileError as exc:
        raise DataError(f"{exc.message} ({exc.rule}); fix: {exc.fix}") from exc
    package = needed_package(files)
    if package is not None:
        try:
            __import__("pyarrow.parquet" if package == "pyarrow" else package)
        except ImportError as exc:
            raise DataError(f"reading {path} needs the `{package}` package (DSF626): pip install "
                            "'dsforge[data]'") from exc
    return files


def records(files: TextFiles, field: str | None) -> Iterator[tuple[str, Any]]:
    """(where, value of ``field``) of every record, in order; ``where`` names file and line for errors."""
    if files.hf is not None:
        yield from _hf_records(files.hf, field)
        return
    for path in files.files:
        if path.suffix == ".txt":
            with path.open(encoding="utf-8", errors="replace") as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        yield f"{path}:{number}", line.rstrip("\n")
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        where = f"{path}:{number}"
                        yield where, _field(_loads(line, where), field, where)
        elif path.suffix == ".json":
            data = _loads(path.read_text(encoding="utf-8"), str(path))
            if not isinstance(data, list):
                raise DataError(f"{path} is not a JSON list of records")
            for number, record in enumerate(data):
                where = f"{path} record {number}"
                yield where, _field(record, field, where)
        else:
            yield from _parquet_records(path, field)


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from exc


def _field(record: Any, field: str | None, where: str) -> Any:
    if not isinstance(record, dict):
        raise DataError(f"{where}: the record is a {type(record).__name__}, "
                        f"not an object with a {field!r} field")
    if field not in record:
        raise DataError(f"{where}: the record has no field {field!r} (it has "
                        f"{', '.join(map(repr, record)) or 'none'}); set training.data.field")
    return record[field]


def _parquet_records(path: Path, field: str | None) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {field!r} (it has {', '.join(pf.schema_arrow.names)}); set "
                        "training.data.field")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield f"{path} row {row}", value
            row += 1


def _hf_records(directory: Path, field: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    ds = datasets.load_from_disk(str(directory))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if field not in ds.column_names:
        raise DataError(f"{directory}: no column {field!r} (it has {', '.join(ds.column_names)}); set "
                        "training.data.field")
    for row, value in enumerate(ds[field]):
        yield f"{directory} row {row}", value
