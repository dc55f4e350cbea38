"""The jinja2 environment of the emitted files: strict undefined names and quoting filters.

Every string that comes from the job file passes a filter fitted to where it lands: ``shquote`` for
shell words (shlex.quote: one single-quoted word, nothing expanded), ``yamlquote`` for YAML scalars
(a double-quoted scalar PyYAML reads back to the same string), ``k8s_literal`` before it for
Kubernetes fields that expand ``$(VAR)`` references, ``slug`` for names with a restricted alphabet,
``directive`` for `#SBATCH` values (checked, since nothing can quote them).
"""

from __future__ import annotations

import hashlib
import re
import shlex
from functools import lru_cache
from typing import Any

import jinja2
import yaml

from dsforge.compiler.emit.ds_config import EmitError
from dsforge.compiler.launch_targets import SBATCH_VALUE
from dsforge.compiler.strict_json import NonFiniteError, dumps


def shquote(value: Any) -> str:
    """One POSIX shell word that expands to exactly ``str(value)``."""
    text = str(value)
    if "\x00" in text:  # no shell string can hold NUL; DSF604 reports it with its location first
        raise EmitError(f"{text!r} contains a NUL character and cannot be written into a script")
    return shlex.quote(text)


def yamlquote(value: Any) -> str:
    """A double-quoted YAML scalar that loads back to exactly ``str(value)`` (escapes included)."""
    out = yaml.dump(str(value), default_style='"', allow_unicode=False, width=float("inf"))
    return out.removesuffix("\n...\n").rstrip("\n")


def directive(value: Any) -> str:
    """A value for an ``#SBATCH`` line, which sbatch splits itself and no shell quotes; anything else is
    refused."""
    text = str(value)
    if not SBATCH_VALUE.match(text):  # DSF604 reports it with its location first
        raise EmitError(f"{text!r} cannot be written into an #SBATCH directive")
    return text


def k8s_literal(value: Any) -> str:
    """Escape ``$`` as ``$$`` so Kubernetes does not expand ``$(VAR)`` in command, args and env values."""
    return str(value).replace("$", "$$")


def slug(value: Any, limit: int = 40) -> str:
    """A DNS-1123 label made of the value (lower-case letters, digits, -), stable and collision-resistant.

    When the name is not already such a label, a short hash of the original is appended, so two
    names that fold to the same letters still get different slugs.
    """
    text = str(value)
    base = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "job"
    if base == text:
        return base
    return f"{base}-{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:6]}"


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and two-space indent: the same data gives the same bytes; EmitError for a NaN or
    an infinity (DSF516 refuses them in `deepspeed:` first; anywhere else it is a bug that must not ship)."""
    try:
        return dumps(value, indent=2, sort_keys=True, ensure_ascii=True)
    except NonFiniteError as exc:
        raise EmitError(f"a JSON file of the job would hold a non-finite number: {exc}") from None


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The shared environment over dsforge/templates (StrictUndefined: a missing name is an error)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("dsforge", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(shquote=shquote, yamlquote=yamlquote, k8s_literal=k8s_literal, slug=slug,
                       canonical_json=canonical_json, directive=directive)
    return env


def render(template: str, **context: Any) -> str:
    """Render one template of dsforge/templates with ``context``."""
    return environment().get_template(template).render(**context)
