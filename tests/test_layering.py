"""The import graph of ``dmuon/``: no cycle, and every import runs down the layering.

Layers, top to bottom (docs/design.md, "Layout"): the training job; the public API; the CLI and
checkpoints; the optimizer; the hook-free ``distributed_config`` path; the owner runtime; the
collectives; the owners' plan and update math; balancing; the kernels and the rank launcher.
A module may import its own package or any lower layer, never a higher one. Imports under
``if TYPE_CHECKING:`` are annotations only and are skipped. Built with ``ast`` (nothing is
imported) and networkx.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parent.parent / "dmuon"

#: Layer of each top-level part of ``dmuon`` (higher imports lower).
LAYERS = {
    "train": 8, "integrations": 8,  # glue to third-party trainers: uses the public API
    "__init__": 7,
    "profile": 6, "checkpoint": 6,
    "optim": 5,
    "distconfig": 4,
    "qk_clip": 2.5,  # QK-clip (issue 40): owners math + a collective, below the optimizer
    "hooks": 3,
    "comm": 2,
    "owners": 1,
    "balance": 0.5,
    "kernels": 0, "faults": 0,
}
#: Parts that must not import ``torch.distributed`` (docs/design.md).
NO_DISTRIBUTED = ("kernels", "balance")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, module: str, is_package: bool, type_checking: bool = False):
    """(imported name, line) of every import outside ``if TYPE_CHECKING:`` blocks (inside them
    too with ``type_checking``)."""
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
        for n in ast.walk(node) if n is not node}
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                origin = ".".join(base[: len(base) - node.level + 1] + ([origin] if origin else []))
            for alias in node.names:  # "from pkg import mod" is an import of pkg.mod
                yield f"{origin}.{alias.name}", node.lineno


def import_graph(type_checking: bool = False) -> nx.DiGraph:
    """Edges ``a -> b``: module ``a`` imports module ``b`` (both in ``dmuon``), with the line;
    with ``type_checking`` also the imports made for annotations only."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = nx.DiGraph()
    for module, path in files.items():
        graph.add_node(module, path=path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line in _imports(tree, module, path.name == "__init__.py", type_checking):
            target = name
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target.startswith("dmuon") and target != module:
                graph.add_edge(module, target, line=line)
    return graph


def test_every_part_has_a_layer():
    parts = {_part(m) for m in import_graph()}
    assert parts <= set(LAYERS), f"give these parts of dmuon a layer in LAYERS: {sorted(parts - set(LAYERS))}"


def test_imports_have_no_cycle():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_imports_run_down_the_layers():
    graph = import_graph()
    upward = [f"{a} (line {graph.edges[a, b]['line']}) imports {b}"
              for a, b in graph.edges if _part(a) != _part(b) and LAYERS[_part(a)] <= LAYERS[_part(b)]]
    assert not upward, "imports against the layering: " + "; ".join(upward)


@pytest.mark.parametrize("part", NO_DISTRIBUTED)
def test_kernels_and_balance_do_not_import_torch_distributed(part):
    found = []
    for path in (PKG / part).rglob("*.py"):
        module = _module_name(path)
        found += [f"{module}:{line}" for name, line in _imports(ast.parse(path.read_text()), module,
                                                                  path.name == "__init__.py")
                  if name.startswith("torch.distributed")]
    assert not found, f"dmuon.{part} must not import torch.distributed: {found}"


def test_hook_runtime_has_no_cycle_even_in_annotations():
    """Units and binding take the runtime state as an object and never import its module:
    nothing in ``dmuon.hooks`` names the hook state back, not even under ``if TYPE_CHECKING:``
    (the old ``unit -> state -> bind`` circle)."""
    graph = import_graph(type_checking=True)
    hooks = graph.subgraph([m for m in graph if m.startswith("dmuon.hooks")])
    cycles = sorted(nx.simple_cycles(hooks), key=len)
    assert not cycles, "annotation-level cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])
    for module in ("dmuon.hooks.unit", "dmuon.hooks.bind"):
        assert not graph.has_edge(module, "dmuon.hooks.state"), module


def test_owner_plan_modules_have_no_cycle_even_in_annotations():
    """Issue 33: the owners' modules import one way, annotations included (the plan's author and
    its expert-parallel path imported each other; both now live in ``dmuon.owners.plan``)."""
    graph = import_graph(type_checking=True)
    owners = graph.subgraph([m for m in graph if m.startswith("dmuon.owners")])
    cycles = sorted(nx.simple_cycles(owners), key=len)
    assert not cycles, "annotation-level cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])
    assert "dmuon.owners.plan" in owners
