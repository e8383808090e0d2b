"""The package's import graph: no cycles, no upward imports, no plugin importing another.

Every ``import`` / ``from ... import`` naming a ``diffusion_kv`` module counts, at module level
and inside functions alike (a function-level import is still a dependency: it only runs later).
The graph is read from the syntax trees of the package's files, nothing is imported.

The layering (``docs/architecture.md``, "The plugin contract"), lowest first; a part may import
only the parts listed for it:

* ``core`` imports no other part (it sees a platform through the ``BackendProvider`` protocol);
* ``platforms`` imports ``core`` (and within ``platforms`` a plugin — ``platforms/cpu``,
  ``platforms/cuda``, ``platforms/npu`` — imports only itself and the shared platform modules:
  ``interface``, ``isolation``, ``selection``, ``torch_sdpa``);
* ``integrations``, ``models``, ``conformance`` and ``testing`` import ``core`` and
  ``platforms``; ``bench`` also ``models`` (it times the demo models);
* ``cli`` imports any part; nothing imports ``cli``;
* ``progress`` (a terminal progress line) imports no other part;
* the package root (``diffusion_kv/__init__.py``, the public facade) imports ``core`` and
  ``platforms``, and no module of the package imports it.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable

import diffusion_kv

PACKAGE = pathlib.Path(diffusion_kv.__file__).parent
ROOT = "diffusion_kv"

ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "platforms": frozenset({"core"}),
    "integrations": frozenset({"core", "platforms"}),
    "models": frozenset({"core", "platforms"}),
    "conformance": frozenset({"core", "platforms"}),
    "testing": frozenset({"core", "platforms"}),
    "bench": frozenset({"core", "platforms", "models"}),
    "progress": frozenset(),
    "cli": frozenset(
        {"core", "platforms", "integrations", "models", "conformance", "testing", "bench", "progress"}
    ),
    ROOT: frozenset({"core", "platforms"}),
}
"""Part -> the parts it may import (a part always may import itself)."""

PLUGINS = frozenset({"cpu", "cuda", "npu"})
"""The built-in plugins under ``platforms/``: none imports another."""

KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()
"""Import cycles tolerated for now, each a set of modules; no other cycle may appear (the last
one, the attention mode and its piecewise mask, went with ``core/attention``)."""


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def _owning_module(name: str) -> str | None:
    """The package module ``name`` lives in (``a.b.C`` -> ``a.b``), None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: pathlib.Path) -> set[str]:
    """Every package module ``module`` imports, at module level or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(
                _owning_module(alias.name) for alias in node.names if alias.name.split(".")[0] == ROOT
            )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != ROOT:
                continue
            for alias in node.names:  # ``from pkg import submodule`` depends on the submodule
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else _owning_module(base))
    found.discard(None)
    found.discard(module)
    return {m for m in found if m is not None}


GRAPH: dict[str, set[str]] = {m: imports_of(m, p) for m, p in MODULES.items()}


def part(module: str) -> str:
    """``core``, ``platforms``, ..., or the root for ``diffusion_kv`` itself."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ROOT


def plugin(module: str) -> str | None:
    pieces = module.split(".")
    if len(pieces) > 2 and pieces[1] == "platforms" and pieces[2] in PLUGINS:
        return pieces[2]
    return None


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(frozenset(component))
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t} ({part(m)} may import {sorted(ALLOWED[part(m)]) or 'no other part'})"
        for m, targets in graph.items()
        for t in targets
        if part(t) != part(m) and part(t) not in ALLOWED[part(m)]
    )


def cross_plugin(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (plugin {plugin(m)!r}) imports {t} (plugin {plugin(t)!r})"
        for m, targets in graph.items()
        for t in targets
        if plugin(t) is not None and plugin(m) != plugin(t) and part(m) == "platforms"
    )


def test_every_part_is_in_the_layering() -> None:
    assert {part(m) for m in MODULES} == set(ALLOWED)
    assert len(MODULES) > 80  # the walk found the package, not an empty folder
    assert "diffusion_kv.platforms.selection" in GRAPH["diffusion_kv.platforms"]


def test_no_import_cycle_but_the_listed_one() -> None:
    found = set(cycles(GRAPH))
    assert found - KNOWN_CYCLES == set(), "import cycles: " + "; ".join(
        " <-> ".join(sorted(c)) for c in found - KNOWN_CYCLES
    )
    assert KNOWN_CYCLES - found == set(), "a listed cycle is gone: delete it from KNOWN_CYCLES"


def test_no_upward_import() -> None:
    assert upward(GRAPH) == []


def test_no_plugin_imports_another() -> None:
    assert cross_plugin(GRAPH) == []


def test_the_interface_and_discovery_do_not_import_each_other() -> None:
    assert "diffusion_kv.platforms.selection" not in GRAPH["diffusion_kv.platforms.interface"]
    assert "diffusion_kv.platforms.interface" in GRAPH["diffusion_kv.platforms.selection"]
    assert "diffusion_kv.platforms.isolation" in GRAPH["diffusion_kv.platforms.interface"]


def test_the_checks_catch_what_they_are_for() -> None:
    """Each rule fails on a graph that breaks it (function-level imports included)."""
    tree = ast.parse("def f():\n    from diffusion_kv.platforms.cuda.backend import X\n")
    (inner,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert inner.module == "diffusion_kv.platforms.cuda.backend"  # ast.walk reaches into functions
    graph = {
        "diffusion_kv.core.a": {"diffusion_kv.platforms.interface"},
        "diffusion_kv.platforms.interface": {"diffusion_kv.core.a"},
        "diffusion_kv.platforms.cpu.sdpa": {"diffusion_kv.platforms.cuda.backend"},
        "diffusion_kv.platforms.cuda.backend": set(),
        "diffusion_kv.models.demo": {"diffusion_kv.cli"},
        "diffusion_kv.cli": set(),
    }
    assert cycles(graph) == [frozenset({"diffusion_kv.core.a", "diffusion_kv.platforms.interface"})]
    assert upward(graph) == [
        "diffusion_kv.core.a imports diffusion_kv.platforms.interface (core may import no other part)",
        "diffusion_kv.models.demo imports diffusion_kv.cli (models may import ['core', 'platforms'])",
    ]
    assert cross_plugin(graph) == [
        "diffusion_kv.platforms.cpu.sdpa (plugin 'cpu') imports diffusion_kv.platforms.cuda.backend (plugin 'cuda')"
    ]
