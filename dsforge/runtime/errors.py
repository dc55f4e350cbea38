"""One base class for every refusal at run time: the job's fault, reported by each rank in one line.

A refusal says what cannot be honoured and how to fix it; the rule id it reports (``DSFnnn``) is its
``rule``, given or read from the message's ``DSFnnn:`` prefix (None for the refusals without an id).
Each refusal keeps its builtin base beside this one (``except ValueError`` / ``except RuntimeError``
still catch what they caught), and dsforge.runtime.main tells a refusal from a crash by this type
alone. The engine's and the model build's classes live here, since the modules below them
(precision, recompute, materialize, pretrained) raise them too.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"(DSF\d{3})\b")


class RuntimeRefusal(Exception):
    """A setting or input the runtime refuses; ``rule`` is the DSF id it reports, or None."""

    rule: str | None

    def __init__(self, *args: object, rule: str | None = None) -> None:
        super().__init__(*args)
        if rule is None and args and isinstance(args[0], str):
            found = _RULE.match(args[0])
            rule = found.group(1) if found else None
        self.rule = rule


class EngineError(RuntimeRefusal, RuntimeError):
    """The engine cannot be built for this plan; the message says why and what to change."""


class ModelBuildError(RuntimeRefusal, ValueError):
    """The model spec cannot be turned into a module (unsupported combination, or a failing factory)."""


class DataError(RuntimeRefusal, ValueError):
    """The job's data cannot be read as configured; the message says what to change."""


class CheckpointError(RuntimeRefusal, RuntimeError):
    """A checkpoint cannot be loaded into this job; the message says which and why."""
