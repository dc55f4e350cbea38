"""The layers point one way (shared/DESIGN.md "Layers point one way"), read from the source with `ast`.

Each contract says: no module whose dotted name starts with ``importer`` imports anything under
``forbidden``; with ``module_level_only`` an import inside a function (or under ``if TYPE_CHECKING:``)
is allowed, since it runs only when called. Adding a contract is one line in CONTRACTS.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import ROOT


class Contract(NamedTuple):
    """Modules under ``importer`` must not import modules under ``forbidden``."""

    importer: str
    forbidden: str
    module_level_only: bool


CONTRACTS = (
    # importer prefix                 forbidden prefix               module level only
    Contract("dsforge.compiler.estimate", "dsforge.compiler.emit", False),
    Contract("dsforge.compiler.emit", "dsforge.compiler.estimate", False),
    Contract("dsforge.compiler.deepspeed.ds_settings", "dsforge.compiler.estimate", False),
    Contract("dsforge.compiler.deepspeed.ds_settings", "dsforge.compiler.emit", False),
    # the extension registry is the bottom layer: each table's owner registers its loader with it
    Contract("dsforge.extensions", "dsforge.compiler", False),
    Contract("dsforge.extensions", "dsforge.runtime", False),
    Contract("dsforge.extensions", "dsforge.plugins", False),
    # the compiler is torch-free at import: the runtime and the trainer integrations are above it
    Contract("dsforge.compiler", "dsforge.plugins", False),
    Contract("dsforge.compiler", "dsforge.runtime", False),
    Contract("dsforge.compiler", "dsforge.commands", False),
    Contract("dsforge.compiler", "dsforge.explain", False),
    Contract("dsforge.compiler", "dsforge.formatters", False),
    Contract("dsforge.compiler", "dsforge.cli", False),
    Contract("dsforge.compiler", "torch", True),
    Contract("dsforge.compiler", "deepspeed", True),
    # rules judge the plan; what the emitter writes they read from ds_settings, not from emit
    Contract("dsforge.compiler.rules", "dsforge.compiler.emit", False),
    Contract("dsforge.formatters", "dsforge.runtime", False),
    Contract("dsforge.explain", "dsforge.runtime", True),
    Contract("dsforge.runtime", "dsforge.plugins", False),
)


class Import(NamedTuple):
    """One imported module name and where the import statement is."""

    module: str
    line: int
    module_level: bool


def under(name: str, prefix: str) -> bool:
    """True when dotted ``name`` is ``prefix`` or inside it (``a.bc`` is not under ``a.b``)."""
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, root: Path) -> str:
    """The dotted module name of a source file below ``root`` (a package's __init__ is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_call(node: ast.AST) -> bool:
    """``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")`` with a literal name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def imports(source: str, importer: str, is_package: bool = False) -> Iterator[Import]:
    """Every module an import statement (or a constant `importlib.import_module`) in ``source`` names.

    ``from a.b import c`` names both ``a.b`` and ``a.b.c``, since ``c`` may be a submodule.
    """

    def walk(nodes: Iterable[ast.AST], module_level: bool) -> Iterator[Import]:
        for node in nodes:
            if isinstance(node, ast.Import):
                yield from (Import(a.name, node.lineno, module_level) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, importer, is_package)
                yield Import(base, node.lineno, module_level)
                yield from (Import(f"{base}.{a.name}", node.lineno, module_level) for a in node.names)
            elif _is_import_call(node):
                assert isinstance(node, ast.Call) and isinstance(node.args[0], ast.Constant)
                yield Import(str(node.args[0].value), node.lineno, module_level)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(ast.iter_child_nodes(node), False)
            elif isinstance(node, ast.If) and _type_checking(node):
                yield from walk(node.body, False)
                yield from walk(node.orelse, module_level)
            else:
                yield from walk(ast.iter_child_nodes(node), module_level)

    yield from walk([ast.parse(source)], True)


def violations(contract: Contract, root: Path) -> list[str]:
    """``file:line: importer imports module`` for every import under ``root`` that breaks the contract."""
    out = []
    for path in sorted((root / "dsforge").rglob("*.py")):
        importer = module_name(path, root)
        if not under(importer, contract.importer):
            continue
        bad = {(imp.line, imp.module) for imp in imports(path.read_text(encoding="utf-8"), importer,
                                                           path.name == "__init__.py")
               if under(imp.module, contract.forbidden) and (imp.module_level or not contract.module_level_only)}
        # `from a.b import c` names a.b and a.b.c: report the statement once, by its shortest name
        out += [f"{path.relative_to(root)}:{line}: {importer} imports {module}" for line, module in sorted(bad)
                if not any(other != module and line == at and under(module, other) for at, other in bad)]
    return out


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: f"{c.importer}-x-{c.forbidden}")
def test_contract_holds(contract: Contract) -> None:
    assert [p for p in (ROOT / "dsforge").rglob("*.py") if under(module_name(p, ROOT), contract.importer)], \
        f"no module is under {contract.importer}: the contract checks nothing (renamed?)"
    found = violations(contract, ROOT)
    where = "" if contract.module_level_only else " (not even inside a function)"
    assert found == [], f"{contract.importer} must not import {contract.forbidden}{where}:\n" + "\n".join(found)


# --- the scanner itself: each way of importing is seen, so the contracts above can fail ------------------

EMIT = "dsforge.compiler.emit"


@pytest.mark.parametrize(("source", "module_level"), [
    ("from dsforge.compiler.emit.ds_config import zero_section\n", True),
    ("import dsforge.compiler.emit.ds_config as dc\n", True),
    ("from dsforge.compiler import emit\n", True),
    ("from ..emit import ds_config\n", True),
    ("from ..emit.ds_config import on_cpu\n", True),
    ("def f():\n    from dsforge.compiler.emit.ds_config import zero_section\n", False),
    ("class A:\n    def m(self):\n        import dsforge.compiler.emit\n", False),
    ("import importlib\ndef f():\n    importlib.import_module('dsforge.compiler.emit.ds_config')\n", False),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsforge.compiler.emit import ds_config\n", False),
])
def test_scanner_sees_every_form_of_import(source: str, module_level: bool) -> None:
    found = [i for i in imports(source, "dsforge.compiler.estimate.memory") if under(i.module, EMIT)]
    assert found and all(i.module_level is module_level for i in found)


@pytest.mark.parametrize("source", [
    "from dsforge.compiler.deepspeed.ds_settings import zero_section\n",
    "from dsforge.compiler.emitter_notes import x\n",  # a sibling whose name merely starts the same
    "from . import memory\n",
    "x = 'dsforge.compiler.emit'\n",
])
def test_scanner_ignores_what_is_not_an_emit_import(source: str) -> None:
    assert not [i for i in imports(source, "dsforge.compiler.estimate.memory") if under(i.module, EMIT)]


def test_relative_imports_resolve_from_a_package_init() -> None:
    [base, *_] = imports("from .memory import estimate_memory\n", "dsforge.compiler.estimate", is_package=True)
    assert base.module == "dsforge.compiler.estimate.memory"


def test_a_violation_in_a_tree_is_reported_with_its_line(tmp_path: Path) -> None:
    pkg = tmp_path / "dsforge" / "compiler" / "estimate"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text('"""x"""\n\ndef f():\n    from dsforge.compiler.emit import ds_config\n')
    strict = Contract("dsforge.compiler.estimate", EMIT, False)
    assert violations(strict, tmp_path) == [
        "dsforge/compiler/estimate/bad.py:4: dsforge.compiler.estimate.bad imports dsforge.compiler.emit"]
    assert violations(strict._replace(module_level_only=True), tmp_path) == []
