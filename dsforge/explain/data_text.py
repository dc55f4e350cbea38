"""The Data table of explain: each corpus's tokens and documents, and the epochs `training.steps` makes over
it."""

from __future__ import annotations

import os
from typing import Any

from dsforge.explain.section import Section
from dsforge.explain.units import count


def shown(path: str) -> str:
    """A corpus path as the user reads it: relative to the working directory when it lies under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def data_section(d: dict[str, Any]) -> Section:
    """One row per corpus (a text path, or each megatron prefix of a blend)."""
    if "error" in d:
        return Section("Data", ["corpus", "tokens"], [["training.data", d["error"]]])
    rows = []
    for c in d["corpora"]:
        tokens = "not tokenized yet" if c["tokens"] is None else f"{c['tokens']:,}"
        docs = "" if c["documents"] is None else f"{c['documents']:,}"
        epochs = "" if c.get("epochs") is None else f"{c['epochs']:.2f}"
        rows.append([shown(c["path"]), tokens, docs,
                     f"{c['samples_per_epoch']:,}" if "samples_per_epoch" in c else "", epochs])
    packing = {True: "packed, per-document attention", "concat": "packed, attention across documents",
               False: "one document per sequence"}[d["packing"]]
    notes = [
        f"training.steps reads {d['samples']:,} sequences ({count(d['train_tokens'])} tokens); {packing}",
        *[
            f"{shown(c['path'])}: {c['note']}"
            for c in d["corpora"]
            if c["tokens"] is None or "cached" in c["note"]
        ],
    ]
    return Section("Data", ["corpus", "tokens", "documents", "sequences/epoch", "epochs"], rows, (1, 2, 3, 4),
                   notes)
