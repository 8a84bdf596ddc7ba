"""No circle between crossover's subpackages: the layers of the design's layout.

`tests/test_imports.py` forbids cycles between modules. This holds the coarser rule:
each subpackage (crossover.freeze, crossover.pipeline, crossover.daemon, ...) and each
top-level module (crossover.trace, ...) is one node, and the arrows between the nodes
never close a circle. Two packages can lean on each other without any module cycle
(a re-plan in the freezing package using the partitioner, while the trainer uses the
freezing criterion), and then neither can be understood, tested or moved without the
other. Every import counts, wherever it is written (inside a function, under
`if TYPE_CHECKING:`).

Run as a script to list the circles: `python -m tests.test_layering [ROOT]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.test_imports import REPO, cycles, import_graph, reach

Arrows = dict[tuple[str, str], list[str]]  # (node, node) -> the module imports behind it


def layer(module: str) -> str:
    """The node a module belongs to: its subpackage, or itself when top-level
    (`crossover.pipeline.train` -> `crossover.pipeline`; `crossover.trace` stays)."""
    return ".".join(module.split(".")[:2])


def layer_graph(root: Path, package: str = "crossover") -> tuple[dict[str, set[str]], Arrows]:
    """The subpackage graph of `package` (a folder under `root`), and for each arrow the
    module imports that draw it (so a failure says which lines to change)."""
    modules = import_graph(root, package)
    graph: dict[str, set[str]] = {layer(m): set() for m in modules}
    arrows: Arrows = {}
    for mod, targets in modules.items():
        for target in targets:
            a, b = layer(mod), layer(target)
            if a != b:  # inside one subpackage the module test rules
                graph[a].add(b)
                arrows.setdefault((a, b), []).append(f"{mod} -> {target}")
    return graph, arrows


def circles(root: Path, package: str = "crossover") -> list[str]:
    """Each circle between the nodes, as its arrows with the imports behind them."""
    graph, arrows = layer_graph(root, package)
    out = []
    for group in cycles(graph):
        edges = [f"{a} -> {b} ({', '.join(sorted(arrows[a, b]))})"
                 for a in group for b in sorted(graph[a]) if b in group]
        out.append("; ".join(edges))
    return out


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pk"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "use.py").write_text("from pk.low import base\n")
    (pkg / "low" / "base.py").write_text("def f():\n    from pk.high.use import g\n")
    (pkg / "top.py").write_text("import pk.low.base\n")  # an arrow down: no circle
    graph, _ = layer_graph(tmp_path, "pk")
    assert graph == {"pk": set(), "pk.high": {"pk.low"}, "pk.low": {"pk.high"},
                     "pk.top": {"pk.low"}}
    assert circles(tmp_path, "pk") == [
        "pk.high -> pk.low (pk.high.use -> pk.low, pk.high.use -> pk.low.base); "
        "pk.low -> pk.high (pk.low.base -> pk.high, pk.low.base -> pk.high.use)"]


def test_no_circle_between_subpackages() -> None:
    found = circles(REPO)
    assert not found, ("subpackages that import each other (move what the lower one "
                       "needs down, or the upper one's code up):\n" + "\n".join(found))


def test_the_freezing_policy_loads_nothing_of_the_pipeline() -> None:
    # freeze/ decides what to freeze and when; acting on it (re-plan, migration, the
    # frozen front's cache) is the pipeline's, which imports the policy
    graph, arrows = layer_graph(REPO)
    assert "crossover.pipeline" not in reach(graph, "crossover.freeze"), \
        [i for (a, _), imports in arrows.items() if a == "crossover.freeze" for i in imports]
    assert "crossover.freeze" in graph["crossover.pipeline"]  # the arrow points down


if __name__ == "__main__":
    found = circles(Path(sys.argv[1]) if sys.argv[1:] else REPO)
    print("\n".join(found) or "no circle")
    sys.exit(1 if found else 0)
