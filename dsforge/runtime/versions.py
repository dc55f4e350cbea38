"""The DeepSpeed versions dsforge supports, checked from package metadata (DeepSpeed is not imported).

The rules, the DeepSpeed key lists and the private DeepSpeed functions the runtime relies on were
written against DeepSpeed 0.19.8 (/work/shared/research/deepspeed.md); a minor release may rename a
config key or a private function, and the failure would then surface deep inside
``deepspeed.initialize`` on every rank. Checking the installed version first turns that into one
sentence with the fix. ``dsforge run`` checks before it launches ranks, the runtime before it starts
an engine, the trainer integrations when they load a job.
"""

from __future__ import annotations

import re
from importlib import metadata

from dsforge.runtime.errors import RuntimeRefusal

#: The supported range, as pip writes it (keep in step with the `runtime` extra in pyproject.toml).
SUPPORTED = ">=0.19.8,<0.20"
MINIMUM = (0, 19, 8)
BELOW = (0, 20, 0)
INSTALL_HINT = "pip install 'deepspeed>=0.19.8,<0.20'"

# PEP 440: a release, then an optional pre-release (a/b/rc), post- or dev-release, then a local label.
_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*?)(?:\+.*)?\s*$", re.IGNORECASE)
_PRE = re.compile(r"^[-_.]?(a|alpha|b|beta|c|rc|pre|preview|dev)", re.IGNORECASE)


class UnsupportedVersionError(RuntimeRefusal, RuntimeError):
    """The installed DeepSpeed is outside the range dsforge supports (the message says which and how to
    fix)."""


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version from its package metadata, or None when it is not installed."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[tuple[int, ...], bool] | None:
    """(release numbers, True for a pre- or dev-release), or None when ``version`` is unreadable."""
    match = _VERSION.match(version)
    if match is None:
        return None
    return tuple(int(n) for n in match.group(1).split(".")), bool(_PRE.match(match.group(2)))


def _padded(numbers: tuple[int, ...], width: int) -> tuple[int, ...]:
    return numbers + (0,) * (width - len(numbers))


def supported(version: str) -> bool:
    """True when ``version`` lies in SUPPORTED (PEP 440: 0.19.8rc1 is below 0.19.8, 0.20.0.dev0 not below
    0.20)."""
    parsed = _release(version)
    if parsed is None:
        return False
    release, pre = parsed
    width = max(len(release), 3)
    release, low, high = _padded(release, width), _padded(MINIMUM, width), _padded(BELOW, width)
    return (release > low or (release == low and not pre)) and release < high


def deepspeed_problem(found: str | None) -> str | None:
    """What is wrong with DeepSpeed version ``found`` (None: not installed), or None when it is supported."""
    if found is None:
        return f"DeepSpeed is not installed; dsforge's runtime needs DeepSpeed {SUPPORTED}: {INSTALL_HINT}"
    if supported(found):
        return None
    return (f"DeepSpeed {found} is installed, but dsforge supports DeepSpeed {SUPPORTED} (its checks, config "
            f"keys and runtime hooks follow 0.19.8): {INSTALL_HINT}")


def require_deepspeed(found: str | None = None, *, installed_only: bool = False) -> None:
    """Raise UnsupportedVersionError unless the installed (or ``found``) DeepSpeed is supported.

    ``installed_only``: a missing DeepSpeed passes (a trainer integration may run without it).
    """
    version = deepspeed_version() if found is None else found
    if version is None and installed_only:
        return
    problem = deepspeed_problem(version)
    if problem is not None:
        raise UnsupportedVersionError(problem)
