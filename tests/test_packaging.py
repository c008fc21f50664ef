"""The installed product runs every command it offers: whatever the shipped code imports at run
time is a `[project] dependency` (a plain `pip install .`, as the Dockerfile does, installs no
test extras)."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"agent", "dra_driver"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        _normalize(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) for d in project["dependencies"]
    }


BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)
"""What holds statements: an import is a statement, found in the statement lists of the module,
a function, a class, a branch, a loop, a ``with``, a ``try`` and its handlers, a ``match`` case
(expressions hold none, so they are not walked: a third of the time the whole tree took)."""


def _imports(tree: ast.Module) -> Iterator[list[str]]:
    """The modules each import statement names, those under ``if TYPE_CHECKING`` (either
    branch) left out."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, ast.Import) and not typing_only:
            yield [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not typing_only and node.level == 0:
            yield [node.module] if node.module else []
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only = True
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                stack.extend((child, typing_only) for child in value if isinstance(child, BLOCKS))


@functools.cache
def _runtime_imports() -> dict[str, frozenset[str]]:
    found: dict[str, set[str]] = {}
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            for names in _imports(ast.parse(path.read_text())):
                for name in names:
                    top = name.split(".")[0]
                    if top not in FIRST_PARTY and top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return {module: frozenset(files) for module, files in found.items()}


def runtime_imports() -> dict[str, set[str]]:
    """Top-level module -> the shipped files importing it at run time (at module level or in a
    function; not under ``if TYPE_CHECKING``). Read once per test process (the tests only read
    the sources); each caller gets its own copy."""
    return {module: set(files) for module, files in _runtime_imports().items()}


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """``metadata.packages_distributions()``: it reads every installed distribution's files."""
    return metadata.packages_distributions()


def test_every_runtime_import_is_a_declared_dependency():
    distributions = _distributions()
    deps = declared()
    missing = {}
    for module, files in runtime_imports().items():
        owners = {_normalize(d) for d in distributions.get(module, [module])}
        if module not in TOOL_ONLY and not owners & deps:
            missing[module] = sorted(files)
    assert missing == {}, f"imported at run time but not in [project] dependencies: {missing}"


def test_the_check_sees_the_imports_that_once_were_missing():
    imports = runtime_imports()
    assert "agent/sim/apiserver_checks.py" in imports["kubernetes_validate"]
    assert {"grpc", "yaml", "rich", "kubernetes", "pynvml"} <= set(imports)
    assert "kubernetes-validate" in extras()["apiserver"]


TOOL_ONLY = {"kubernetes_validate": "apiserver"}
"""Imports of tools the package ships beside the agent, and the extra that installs each: the
API-server emulator's schema check (``agent/sim/apiserver_checks.py``)."""


def extras() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        extra: {_normalize(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) for d in deps}
        for extra, deps in project["optional-dependencies"].items()
    }


def owners(module: str) -> set[str]:
    return {_normalize(d) for d in _distributions().get(module, [module])}


def test_every_declared_dependency_is_imported_by_the_runtime():
    """Nothing in [project] dependencies that the shipped runtime does not import (a tool's or a
    test's package belongs in an extra)."""
    imported = set().union(*(owners(m) for m in runtime_imports() if m not in TOOL_ONLY))
    assert declared() - imported == set()


def test_tool_imports_come_from_their_extra_not_the_runtime():
    found = extras()
    for module, extra in TOOL_ONLY.items():
        assert owners(module) & found[extra], f"{module}: not in the {extra} extra"
        assert not owners(module) & declared(), f"{module}: a tool's import in the runtime"
        assert found[extra] <= found["test"], f"the tests run the {extra} tool"
