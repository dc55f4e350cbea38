"""One table of explain's output, shared by the text and HTML views and by every section builder."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Section:
    """One table: a title, column headers, rows of cells, the right-aligned columns and notes under it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    right: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
