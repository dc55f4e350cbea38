"""`arch: auto`: recognising a model family from its module structure alone.

A family is recognised when every regex of its signature names some module, none of its ``absent``
regexes does, and its policy (with
the job's own `rewrite:` rules in front) places every parameter-owning module. Families are tried
most specific first (Mixtral before Llama: a Mixtral also has Llama's attention).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from dsforge.compiler.model.rewrite_policies import DETECT_ORDER, POLICIES, load_plugins, rows_for
from dsforge.runtime.rewrite.walk import group_names, match_rows

if TYPE_CHECKING:
    from dsforge.compiler.spec.schema import RewriteRule


def why_not(model: nn.Module, arch: str, rules: Sequence[RewriteRule]) -> str | None:
    """Why ``arch``'s policy does not recognise the model, or None when it does."""
    policy = POLICIES[arch]
    names = [n for n, _ in model.named_modules()]
    missing = [rx for rx in policy.signature if not any(re.fullmatch(rx, n) for n in names)]
    if missing:
        return f"no module matches {', '.join(missing)}"
    present = [rx for rx in policy.absent if any(re.fullmatch(rx, n) for n in names)]
    if present:
        return f"has modules matching {', '.join(present)}, which this family does not have"
    walk = match_rows(model, rows_for(arch, rules))
    if walk.leftover:
        return "leaves " + ", ".join(group_names(walk.leftover)) + " unplaced"
    return None


def detect_arch(model: nn.Module,
                rules: Sequence[RewriteRule] | None = None) -> tuple[str | None, dict[str, str]]:
    """The recognised family (or None) and, for every family tried and rejected, the reason."""
    reasons: dict[str, str] = {}
    load_plugins()  # plugin families join DETECT_ORDER when first needed
    for arch in DETECT_ORDER:
        reason = why_not(model, arch, list(rules or []))
        if reason is None:
            return arch, reasons
        reasons[arch] = reason
    return None, reasons
