"""DSF9xx: dsforge's own failures, reported as diagnostics so the other checks still run."""

from __future__ import annotations

from dsforge.compiler.rules.registry import report_id

report_id("DSF900", "internal error in a rule",
          "A check raised an exception; it is reported instead of crashing, so every other check still runs "
          "(as cfn-lint does). Please report it.", "dsforge")
