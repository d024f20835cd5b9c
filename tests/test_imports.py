"""The package's import structure: no import cycle, and no layer importing one above it.

Every module of ``megatron_mtraining`` (``patches/`` included, installed as
``megatron_mtraining.patches``) is read with ``ast``, and each import of another module of
the package is an edge, wherever it stands: at module level, under ``TYPE_CHECKING``, or
inside a function (the lazy imports that keep Triton and Megatron optional count too: a
cycle through them still ties the modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"megatron_mtraining": ROOT / "megatron_mtraining", "megatron_mtraining.patches": ROOT / "patches"}

# Lowest first: a module may import modules of its own layer and of those below it only.
# A module belongs to the first layer one of whose packages holds it.
LAYERS = (
    ("sparse", ("megatron_mtraining.sparse",)),
    ("context_parallel", ("megatron_mtraining.context_parallel",)),
    ("patterns", ("megatron_mtraining.patterns",)),
    ("megatron adapter and patches", ("megatron_mtraining.megatron", "megatron_mtraining.patches")),
    (
        "training program and planner",
        (
            "megatron_mtraining.training",
            "megatron_mtraining.pretrain",
            "megatron_mtraining.planning",
            "megatron_mtraining.plan",
        ),
    ),
    ("examples, data and conversion", ("megatron_mtraining",)),
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for name, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            found[".".join([name, *(parts[:-1] if package else parts)])] = (path, package)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a ``from X import name`` names the
    submodule ``X.name`` where there is one, else ``X``)."""
    modules = _modules()
    graph = {}
    for module, (path, package) in modules.items():
        here = module.split(".") if package else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules:
                        targets.add(target)
        graph[module] = targets - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = set()
            while v not in component:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def _layer(module: str) -> int:
    return next(
        i for i, (_, packages) in enumerate(LAYERS) for p in packages if module == p or module.startswith(p + ".")
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _import_graph()


def test_the_walk_sees_the_package(graph):
    """The graph holds every layer and the lazy imports (a guard against a walk that finds
    nothing and so passes everything)."""
    assert {_layer(m) for m in graph} == set(range(len(LAYERS)))
    assert "megatron_mtraining.sparse.kernels.block_bar.attention" in graph["megatron_mtraining.sparse.attention"]
    assert "megatron_mtraining.patterns.base" in graph["megatron_mtraining.patterns.msa"]


def test_no_import_cycle(graph):
    cycles = set(_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_no_layer_imports_a_higher_one(graph):
    upward = sorted(
        f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
        for m, targets in graph.items()
        for t in targets
        if _layer(t) > _layer(m)
    )
    assert not upward, "\n".join(upward)


def test_index_types_know_nothing_of_the_kernels(graph):
    """The index dataclasses are plain data: nothing ``sparse.index`` imports, directly or
    not, is a kernel module (the kernels' tile tables are kept apart, ``tables.keep_tables``)."""
    reached, todo = set(), ["megatron_mtraining.sparse.index"]
    while todo:
        for t in graph[todo.pop()] - reached:
            reached.add(t)
            todo.append(t)
    assert not {m for m in reached if m.startswith("megatron_mtraining.sparse.kernels")}
