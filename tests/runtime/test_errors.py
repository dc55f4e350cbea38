"""One base for every refusal at run time (dsforge.runtime.errors): found in the source, so a new class is
checked."""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.conftest import ROOT

pytest.importorskip("torch")

from dsforge.runtime.errors import EngineError, ModelBuildError, RuntimeRefusal

RUNTIME = ROOT / "dsforge" / "runtime"
#: Exception classes of the runtime that are not refusals: a failure injected on purpose by the fault hook.
NOT_REFUSALS = {"dsforge.runtime.faults:InjectedFault"}


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in dsforge/runtime whose name ends in Error or that derives an
    exception."""
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if node.name.endswith("Error") or bases & {"Exception", "RuntimeError", "ValueError"}:
                    found.append((module, node.name))
    return found


def test_every_runtime_exception_is_a_refusal() -> None:
    classes = _exception_classes()
    assert len(classes) >= 19  # the 19 of the issue, and the base's two that live beside it
    wrong = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        if f"{module}:{name}" in NOT_REFUSALS:
            assert not issubclass(cls, RuntimeRefusal), name
        elif not issubclass(cls, RuntimeRefusal):
            wrong.append(f"{module}.{name}")
    assert wrong == [], f"runtime refusals outside dsforge.runtime.errors.RuntimeRefusal: {wrong}"


@pytest.mark.parametrize("message, given, rule", [
    ("DSF642: no rank of the checkpoint saved the state of w", None, "DSF642"),
    ("DSF6421 is no id", None, None),
    ("the engine cannot be built (DSF140)", None, None),  # only a leading id is the refusal's own
    ("cannot rewrite the model", "DSF607", "DSF607"),
    ("DSF642: a message", "DSF643", "DSF643"),  # a given rule wins over the message
])
def test_the_rule_comes_from_the_message_or_is_given(message: str, given: str | None,
                                                     rule: str | None) -> None:
    exc = RuntimeRefusal(message, rule=given)
    assert exc.rule == rule and str(exc) == message


def test_builtin_bases_are_kept() -> None:
    # `except ValueError` / `except RuntimeError` written before the common base still catch what they caught
    from dsforge.runtime.checkpoint import CheckpointError
    from dsforge.runtime.data import DataError
    from dsforge.runtime.pretrained import PretrainedLoadError

    assert issubclass(ModelBuildError, ValueError) and issubclass(PretrainedLoadError, ModelBuildError)
    assert issubclass(EngineError, RuntimeError) and issubclass(CheckpointError, RuntimeError)
    assert issubclass(DataError, ValueError)
    with pytest.raises(ValueError, match="^DSF011"):
        raise PretrainedLoadError("DSF011: unreadable")
    assert PretrainedLoadError("DSF011: unreadable").rule == "DSF011"
