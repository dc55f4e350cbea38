"""The layers point one way (shared/DESIGN.md "Layers point one way"), read from the source with `ast`.

Each contract says: no module whose dotted name starts with ``importer`` imports anything under
``forbidden``; with ``module_level_only`` an import inside a function (or under ``if TYPE_CHECKING:``)
is allowed, since it runs only when called. Adding a contract is one line in CONTRACTS.

Over the whole import graph (every import, inside functions and under ``TYPE_CHECKING`` too): no two
modules import each other, directly or through others, and nothing under dsforge.compiler reaches the
runtime, the commands, the trainer plugins or the command line through any chain of imports.
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
               if under(imp.module,
                        contract.forbidden) and (imp.module_level or not contract.module_level_only)}
        # `from a.b import c` names a.b and a.b.c: report the statement once, by its shortest name
        out += [
            f"{path.relative_to(root)}:{line}: {importer} imports {module}"
            for line, module in sorted(bad)
            if not any(other != module and line == at and under(module, other) for at, other in bad)
        ]
    return out


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: f"{c.importer}-x-{c.forbidden}")
def test_contract_holds(contract: Contract) -> None:
    assert [p for p in (ROOT / "dsforge").rglob("*.py") if under(module_name(p, ROOT), contract.importer)], \
        f"no module is under {contract.importer}: the contract checks nothing (renamed?)"
    found = violations(contract, ROOT)
    where = "" if contract.module_level_only else " (not even inside a function)"
    assert found == [], f"{contract.importer} must not import {contract.forbidden}{where}:\n" + "\n".join(
        found
    )


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
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsforge.compiler.emit import ds_config\n",
     False),
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
    [base, *_] = imports("from .memory import estimate_memory\n", "dsforge.compiler.estimate",
                         is_package=True)
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


# --- the whole graph: no cycles, and the compiler reaches nothing above it -------------------------------

#: What no module under dsforge.compiler may reach through any chain of imports.
ABOVE_THE_COMPILER = ("dsforge.runtime", "dsforge.commands", "dsforge.plugins", "dsforge.cli")


def _statements(source: str, importer: str, is_package: bool) -> Iterator[list[str]]:
    """Each import statement (or constant ``import_module``) as the names it may load, anywhere in the source:
    ``from a import b, c`` is ``[a, a.b, a.c]``, ``import a.b`` is ``[a.b]``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ([a.name] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer, is_package)
            yield [base, *(f"{base}.{a.name}" for a in node.names)]
        elif _is_import_call(node):
            assert isinstance(node, ast.Call) and isinstance(node.args[0], ast.Constant)
            yield [str(node.args[0].value)]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree under ``root``/dsforge it imports (at any level of its code).

    ``from a import b`` imports the module ``a.b`` where there is one, and ``a`` itself only for a name that
    is not a submodule (a package's own code runs then, and what it imports counts)."""
    files = {module_name(p, root): p for p in sorted((root / "dsforge").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for base, *names in _statements(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if not names:
                edges.add(base)
                continue
            subs = [n for n in names if n in files]
            edges.update(subs)
            if len(subs) < len(names):
                edges.add(base)
        graph[module] = {m for m in edges if m in files and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reached(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches through imports, each with the module that imports it on the first
    path."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for child in sorted(graph[node]):
            if child not in via and child != start:
                via[child] = node
                todo.append(child)
    return via


def _path(via: dict[str, str], start: str, end: str) -> str:
    chain = [end]
    while chain[-1] != start:
        chain.append(via[chain[-1]])
    return " -> ".join(reversed(chain))


def test_no_two_modules_import_each_other() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 100 and "dsforge.compiler.validate" in graph
    found = cycles(graph)
    assert found == [], "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_compiler_reaches_nothing_above_it() -> None:
    graph = import_graph(ROOT)
    bad = []
    for module in sorted(m for m in graph if under(m, "dsforge.compiler")):
        via = reached(graph, module)
        bad += [_path(via, module, m) for m in sorted(via) if any(under(m, a) for a in ABOVE_THE_COMPILER)]
    assert bad == [], "the compiler imports what is above it, at some depth:\n" + "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_a_cycle_through_a_function_import_and_a_third_module_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "dsforge/__init__.py": "",
        "dsforge/a.py": "from dsforge.b import x\n",
        "dsforge/b.py": "def f():\n    from dsforge import c\n",
        "dsforge/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsforge.a import y\n",
        "dsforge/d.py": "import dsforge.a\n",
    })
    assert cycles(import_graph(root)) == [["dsforge.a", "dsforge.b", "dsforge.c"]]


def test_a_submodule_import_does_not_count_as_importing_its_package(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "dsforge/__init__.py": "",
        "dsforge/p/__init__.py": "from dsforge.p.q import Q\n",
        "dsforge/p/q.py": "from dsforge.p import r\nQ = 1\n",
        "dsforge/p/r.py": "R = 2\n",
    })
    graph = import_graph(root)
    assert graph["dsforge.p"] == {"dsforge.p.q"} and graph["dsforge.p.q"] == {"dsforge.p.r"}
    assert cycles(graph) == []
    (root / "dsforge/p/r.py").write_text("from dsforge.p import Q\n")  # a name of the package: its code runs
    assert cycles(import_graph(root)) == [["dsforge.p", "dsforge.p.q", "dsforge.p.r"]]


def test_what_the_compiler_reaches_is_followed_through_other_modules(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "dsforge/__init__.py": "",
        "dsforge/compiler/__init__.py": "",
        "dsforge/compiler/x.py": "from dsforge import helpers\n",
        "dsforge/helpers.py": "import importlib\ndef f():\n    "
                              "importlib.import_module('dsforge.runtime.api')\n",
        "dsforge/runtime/__init__.py": "",
        "dsforge/runtime/api.py": "",
    })
    via = reached(import_graph(root), "dsforge.compiler.x")
    assert _path(via, "dsforge.compiler.x", "dsforge.runtime.api") == (
        "dsforge.compiler.x -> dsforge.helpers -> dsforge.runtime.api")
