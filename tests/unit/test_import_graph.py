"""The library's module graph: no import cycles (function-local imports included), no private names
reached across packages, and every module imports.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` statement
anywhere in a module (top level, functions, ``try`` blocks) is an edge, because a function-local
import still runs the imported module when the function is called, and a cycle through it fails or
half-initialises a module at that moment.

What an import statement depends on (its edges):

* ``import a.b.c``: the module ``a.b.c``;
* ``from P import x``: ``P`` (its ``__init__``), and ``P.x`` too when ``x`` is a submodule;
* plus every package ``__init__`` above those that the importing module is not itself inside
  (importing ``peagle.data.chat`` from ``peagle.cli`` runs ``peagle/data/__init__.py`` first).

How package ``__init__`` re-exports count: an ``__init__`` that imports its submodules (to re-export
their names) depends on them, as any module does; a submodule that names its own package
(``from . import sibling``, ``from . import name``) depends on that ``__init__``, so the pair is a
cycle (the statement reads ``sibling`` off a package object that is still being initialised). Import
the defining submodule directly: ``from .sibling import name``.

Cycles are looked for twice: between modules, and between the members of every package (a
subpackage standing for everything inside it, its entry point ``__main__`` included), so two packages
that use each other through different modules are a cycle too (``peagle.evaluate`` <-> ``peagle.vllm_run``
was one).

Entry points (every ``__main__``, the console scripts of ``pyproject.toml`` and every module of the
commands package ``peagle.commands``, the command lines ``peagle`` dispatches to) depend on the
assembly (``peagle.run_config``, where every package's settings section meets); the assembly and the
library do not depend on them: only an entry point imports an entry point. An entry point reaching
the assembly reaches every package the assembly imports, so in the package graphs its import of the
assembly stands for the assembly's own imports: ``python -m peagle.train`` validates the evaluate
section, so ``peagle.train`` depends on ``peagle.evaluate``, and ``peagle.evaluate`` must not depend
on ``peagle.train`` (it did, through ``train.elements``). The assembly reaching back into the entry's
own package (``train.settings``) is not a cycle: it stays inside that package.

A private name (``_x``, not a dunder) belongs to its package: a module may import ``_x`` from, or use
``module._x`` of, a module of its own package only (the package of ``peagle.pipeline.trainjob`` is
``peagle.pipeline``; of a package ``__init__``, the package itself).
"""
from __future__ import annotations

import ast
import importlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO

import pytest

PROJECT = REPO
SRC = PROJECT / "src"
ROOT = "peagle"
ASSEMBLY = "peagle.run_config"
COMMANDS = "peagle.commands"  # command modules: entry points, like the __main__ modules

# Each entry is the exact set of modules in one allowed strongly connected component (none now).
ALLOWED_CYCLES: list[frozenset[str]] = []


def module_files() -> dict[str, Path]:
    """Module name -> source file, for every module under src/peagle."""
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = module_files()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def package_of(module: str) -> str:
    """The package a module belongs to (a package ``__init__`` belongs to itself)."""
    return module if module in PACKAGES else module.rpartition(".")[0]


def entry_points() -> set[str]:
    """Every ``__main__`` module, the modules of the console scripts (``[project.scripts]``) and every module
    of the commands package (:data:`COMMANDS`)."""
    scripts = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"].get("scripts", {})
    return ({m for m in MODULES if m.rsplit(".", 1)[-1] == "__main__"}
            | {target.split(":")[0] for target in scripts.values()}
            | {m for m in MODULES if m == COMMANDS or m.startswith(COMMANDS + ".")})


ENTRY_POINTS = entry_points()


@dataclass(frozen=True)
class Import:
    module: str    # the importing module
    target: str    # the peagle module the statement names
    names: tuple[str, ...]  # the names taken from it (``from target import names``); () for ``import``
    line: int


def imports_of(module: str) -> list[Import]:
    """Every import of a peagle module in ``module``'s source, resolved to module names: one
    :class:`Import` per module a statement names (``from P import sub, name``: ``P.sub`` and ``P``)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    assert alias.name in MODULES, f"{MODULES[module]}:{node.lineno}: unknown module {alias.name}"
                    out.append(Import(module, alias.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(module).split(".")
                base = base[:len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            if base_name.split(".")[0] != ROOT:
                continue
            assert base_name in MODULES, f"{MODULES[module]}:{node.lineno}: imports unknown module {base_name}"
            plain = []
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                if sub in MODULES:  # `from pkg import submodule`
                    out.append(Import(module, sub, (), node.lineno))
                else:
                    plain.append(alias.name)
            out.append(Import(module, base_name, tuple(plain), node.lineno))
    return out


def edges_of(imp: Import) -> set[str]:
    """The modules an import runs (see the module docstring): the target and the package inits above it
    that the importing module is not inside."""
    out = {imp.target}
    parts = imp.target.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if not (imp.module == pkg or imp.module.startswith(pkg + ".")):
            out.add(pkg)
    out.discard(imp.module)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the modules its imports run (:func:`edges_of`)."""
    return {m: {e for imp in imports_of(m) for e in edges_of(imp)} for m in MODULES}


def through_the_assembly(g: dict[str, set[str]], entries: set[str], assembly: str) -> dict[str, set[str]]:
    """``g`` with each entry point's import of ``assembly`` standing for what the assembly imports (see
    the module docstring): the graph the package cycles are looked for in."""
    return {m: (targets - {assembly}) | g.get(assembly, set()) if m in entries and assembly in targets
            else targets for m, targets in g.items()}


def member_graphs(g: dict[str, set[str]], packages: set[str]) -> dict[str, dict[str, set[str]]]:
    """Per package: its members' graph (a member subpackage stands for everything inside it, its
    ``__main__`` included)."""
    def member(pkg: str, module: str) -> str | None:
        if not module.startswith(pkg + "."):
            return None
        return pkg + "." + module[len(pkg) + 1:].split(".")[0]

    out = {}
    for pkg in packages:
        mg: dict[str, set[str]] = {}
        for m, targets in g.items():
            a = member(pkg, m)
            if a is None:
                continue
            mg.setdefault(a, set())
            mg[a] |= {b for t in targets if (b := member(pkg, t)) is not None and b != a}
        out[pkg] = mg
    return out


def all_cycles(g: dict[str, set[str]], entries: set[str] = frozenset(), assembly: str = ASSEMBLY,
               packages: set[str] = PACKAGES) -> list[list[str]]:
    """Cycles between modules and between the members of each package (``entries`` reaching through
    ``assembly``, :func:`through_the_assembly`), each once."""
    found = {frozenset(c) for c in strongly_connected(g)}
    for mg in member_graphs(through_the_assembly(g, set(entries), assembly), packages).values():
        found |= {frozenset(c) for c in strongly_connected(mg)}
    return sorted(sorted(c) for c in found)


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively; components of more than one module, sorted."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return sorted(comps)


def describe(comp: list[str]) -> str:
    """One cycle's members and, for each, the import lines that lead to the others."""
    lines = [" <-> ".join(comp)]

    def inside(m: str, member: str) -> bool:  # a member stands for its subtree unless others are in it
        subtree = not any(o.startswith(member + ".") for o in comp)
        return m == member or (subtree and m.startswith(member + "."))

    def hits(member: str, edges: set[str]) -> list[str]:
        return sorted(o for o in comp if o != member and any(inside(e, o) for e in edges))

    assembly_edges = graph()[ASSEMBLY]
    for member in comp:
        for m in sorted(x for x in MODULES if inside(x, member)):
            for imp in imports_of(m):
                where = f"    {MODULES[m].relative_to(SRC.parent)}:{imp.line} -> "
                if hit := hits(member, edges_of(imp)):
                    lines.append(where + ", ".join(hit))
                if m in ENTRY_POINTS and imp.target == ASSEMBLY and (hit := hits(member, assembly_edges)):
                    lines.append(where + f"{', '.join(hit)} (through {ASSEMBLY})")
    return "\n".join(sorted(set(lines), key=lines.index))


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(g) == [["a", "b", "c"]]


def test_the_edges_follow_the_package_inits_python_runs():
    inside = Import("peagle.data.prepare", "peagle.data.chat", ("x",), 1)
    outside = Import("peagle.cli", "peagle.data.chat", ("x",), 1)
    assert edges_of(inside) == {"peagle.data.chat"}
    assert edges_of(outside) == {"peagle.data.chat", "peagle.data"}


def test_packages_that_use_each_other_are_a_cycle():
    g = {"p": set(), "p.a": {"q.x"}, "q": set(), "q.x": set(), "q.y": {"p.a"}, "q.__main__": {"p.a"}}
    assert all_cycles(g) == []  # p.a -> q.x, q.y -> p.a: no module cycle, and q.x never uses p
    g["q.x"] = {"p.a"}
    assert ["p.a", "q.x"] in all_cycles(g)


def test_an_entry_point_counts_with_its_package_and_reaches_through_the_assembly():
    g = {"r": set(), "r.assembly": {"r.t.settings", "r.e.settings"}, "r.t": set(), "r.t.settings": set(),
         "r.t.loop": set(), "r.t.__main__": {"r.assembly", "r.t.loop"}, "r.e": set(), "r.e.settings": set(),
         "r.e.offline": set()}
    check = dict(entries={"r.t.__main__"}, assembly="r.assembly", packages={"r", "r.t", "r.e"})
    assert all_cycles(g, **check) == []  # the assembly reading r.t.settings back is no cycle
    g["r.e.offline"] = {"r.t.loop"}  # r.t's entry point reaches r.e (through the assembly), r.e uses r.t
    assert all_cycles(g, **check) == [["r.e", "r.t"]]
    # not taken as an entry point, r.t.__main__ would make r.t and the assembly a cycle of their own
    assert all_cycles(g, entries=set(), assembly="r.assembly", packages={"r", "r.t", "r.e"}) == [
        ["r.assembly", "r.e", "r.t"]]


def test_only_entry_points_import_entry_points():
    """The assembly and the library do not depend on the entry points (``peagle.cli`` dispatching to
    ``python -m`` entry points is an entry point using another)."""
    found = sorted(f"{MODULES[m].relative_to(SRC.parent)}:{imp.line} -> {imp.target}" for m in MODULES
                   if m not in ENTRY_POINTS for imp in imports_of(m) if imp.target in ENTRY_POINTS)
    assert not found, "entry points imported by the library:\n" + "\n".join(found)


def test_no_import_cycles():
    cycles = [c for c in all_cycles(graph(), ENTRY_POINTS) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "import cycles (function-local imports count):\n" + "\n".join(describe(c) for c in cycles)


def test_the_allowed_cycles_still_exist():
    """An allowed cycle that is gone must leave the list (so the list never hides a new one)."""
    found = {frozenset(c) for c in all_cycles(graph(), ENTRY_POINTS)}
    assert [sorted(c) for c in ALLOWED_CYCLES if c not in found] == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reach_ins() -> list[str]:
    """``from other_package.m import _x`` and ``m._x`` where ``m`` is a module of another package."""
    found = []
    for module, path in MODULES.items():
        own = package_of(module)
        imports = imports_of(module)
        for imp in imports:
            for name in imp.names:
                if _private(name) and package_of(imp.target) != own:
                    found.append(f"{path.relative_to(SRC.parent)}:{imp.line}: from {imp.target} import {name}")
        # names bound to peagle modules in this file: `import a.b as m`, `from a import b` (b a module)
        bound: dict[str, str] = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                for imp in imports:
                    if imp.line == node.lineno and not imp.names:
                        for alias in node.names:
                            if imp.target.endswith("." + alias.name):
                                bound[alias.asname or alias.name] = imp.target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                    and node.value.id in bound and package_of(bound[node.value.id]) != own):
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_private_names_reached_across_packages():
    found = private_reach_ins()
    assert not found, "private names used outside their package (give them a public name):\n" + "\n".join(found)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    importlib.import_module(module)


# ---- floors: the structure picture of docs/structure.md ------------------------------------------------
STRUCTURE = PROJECT / "docs" / "structure.md"


def floors() -> dict[str, int]:
    """``peagle.<package>`` -> its floor, from the table of docs/structure.md (``peagle`` is the root)."""
    out = {}
    for line in STRUCTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in cells[1].split(","):
                name = name.strip()
                out[ROOT if name == ROOT else f"{ROOT}.{name}"] = int(cells[0])
    return out


def top_package(module: str) -> str:
    """The member of ``peagle`` a module belongs to: ``peagle.rollout.cli`` -> ``peagle.rollout``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def floor_violations(g: dict[str, set[str]], floor_of: dict[str, int], entries: set[str]) -> list[str]:
    """Every import of a module (not an entry point) that reaches a package on its own floor or above, and every
    package without a floor."""
    found = set()
    for module, targets in g.items():
        if module in entries:
            continue
        own = top_package(module)
        for target in targets:
            other = top_package(target)
            if other == own:
                continue
            missing = [p for p in (own, other) if p not in floor_of]
            if missing:
                found.add(f"{missing[0]} has no floor in docs/structure.md")
            elif floor_of[other] >= floor_of[own]:
                found.add(f"{module} (floor {floor_of[own]}) imports {target} (floor {floor_of[other]})")
    return sorted(found)


def test_the_floor_rule_finds_an_import_upwards():
    g = {"peagle.data.a": {"peagle.train.b"}, "peagle.train.b": {"peagle.data.a"}, "peagle.new.c": set(),
         "peagle.cli": {"peagle.pipeline.x"}}
    found = floor_violations(g, {"peagle.data": 3, "peagle.train": 6}, entries={"peagle.cli"})
    assert found == ["peagle.data.a (floor 3) imports peagle.train.b (floor 6)"]
    assert floor_violations({"peagle.new.c": {"peagle.data.a"}}, {"peagle.data": 3}, set()) == [
        "peagle.new has no floor in docs/structure.md"]


def test_no_package_imports_one_on_its_floor_or_above():
    floor_of = floors()
    assert floor_of[ROOT] == 0 and len(floor_of) >= 20
    entries = ENTRY_POINTS | {"peagle.cli"}
    found = floor_violations(graph(), floor_of, entries)
    packages = {top_package(m) for m in MODULES if m not in entries}
    found += [f"{p} has no floor in docs/structure.md" for p in sorted(packages - set(floor_of))]
    assert not found, "imports against the floors of docs/structure.md:\n" + "\n".join(sorted(set(found)))
