"""No import cycles: dependencies point down (docs: the design's layout).

Every import counts, wherever it is written (module top, inside a function, under
`if TYPE_CHECKING:`): a cycle hidden in a function is still two modules that cannot be
understood, tested or changed apart. Importing `a.b.c` also runs the package `a.b`'s
`__init__`, so that is an edge too, except into the importer's own packages (already
being imported when it runs).

Run as a script to list every cycle in the package: `python tests/test_imports.py`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`) by dotted name."""
    out = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, anywhere in it."""
    known = set(known)
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import x` mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            # the longest known prefix, with every package above it (their __init__ runs)
            parts = target.split(".")
            for i in range(len(parts), 0, -1):
                mod = ".".join(parts[:i])
                if mod in known and not (name == mod or name.startswith(mod + ".")):
                    found.add(mod)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the package it imports."""
    mods = module_names(root, package)
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]], within: Iterable[str] = ("",)) -> list[list[str]]:
    """The import cycles (strongly connected groups of modules, or a module importing
    itself) that hold a module whose name starts with one of the prefixes `within`
    (the default: every module). Tarjan's algorithm, iteratively."""
    prefixes = tuple(within)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if (len(group) > 1 or v in graph[v]) and \
                        any(m.startswith(prefixes) for m in group):
                    out.append(sorted(group))
    return out


def describe(graph: dict[str, set[str]], group: list[str]) -> str:
    """One cycle as `a -> b -> a` with every import inside the group listed."""
    edges = [f"{a} -> {b}" for a in group for b in sorted(graph[a]) if b in group]
    return f"{len(group)} modules: " + "; ".join(edges)


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"p.a": {"p.b"}, "p.b": {"p.a", "q.c"}, "q.c": set(), "q.d": {"q.d"}}
    assert cycles(graph) == [["p.a", "p.b"], ["q.d"]]
    assert cycles(graph, ("q.",)) == [["q.d"]]


def test_imports_resolve_to_modules_and_their_packages(tmp_path):
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pk.sub import low\n")
    (pkg / "sub" / "low.py").write_text("from ..top import x\n")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pk.sub.low import y\n")
    graph = import_graph(tmp_path, "pk")
    assert graph == {"pk": set(), "pk.sub": {"pk.sub.low"}, "pk.sub.low": {"pk.top"},
                     "pk.top": {"pk.sub", "pk.sub.low"}}
    assert cycles(graph) == [["pk.sub", "pk.sub.low", "pk.top"]]


@pytest.mark.parametrize("within", [("crossover",)])
def test_no_import_cycle(within):
    graph = import_graph(REPO, "crossover")
    found = cycles(graph, within)
    assert not found, "import cycles (make the lower module not import the upper one):\n" \
        + "\n".join(describe(graph, g) for g in found)


#: Who may not import whom: the job side never loads the scheduler or the daemon, the
#: daemon never the client, the scheduler (pure) nothing with I/O, the freezing policy
#: nothing of the pipeline that acts on it.
FORBIDDEN = [
    ("crossover.client", ("crossover.scheduler", "crossover.daemon", "crossover.session")),
    ("crossover.daemon", ("crossover.client", "crossover.session", "crossover.pipeline")),
    ("crossover.scheduler", ("crossover.client", "crossover.daemon", "crossover.transport",
                             "crossover.slot_table", "crossover.session")),
    ("crossover.protocol", ("crossover.client", "crossover.daemon", "crossover.scheduler")),
    ("crossover.freeze", ("crossover.pipeline",)),
]


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` loads, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("lower, uppers", FORBIDDEN)
def test_every_arrow_points_down(lower, uppers):
    graph = import_graph(REPO, "crossover")
    for mod in [m for m in graph if m == lower or m.startswith(lower + ".")]:
        wrong = sorted(m for m in reach(graph, mod) if m.startswith(uppers))
        assert not wrong, f"{mod} loads {wrong}"


def test_import_crossover_loads_neither_the_client_nor_the_daemon():
    code = ("import sys, crossover\n"
            "print(sorted(m for m in sys.modules if m.startswith(('crossover.client', "
            "'crossover.daemon', 'crossover.scheduler', 'crossover.session'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=REPO).stdout
    assert out.strip() == "[]", out


if __name__ == "__main__":
    g = import_graph(REPO, "crossover")
    groups = cycles(g, sys.argv[1:] or ("",))
    for grp in groups:
        print(describe(g, grp))
    sys.exit(1 if groups else 0)
