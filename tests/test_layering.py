"""The layers of `vflash_core` import only downward and no two modules import each other, read from the source.

Every `.py` file under `vflash_core/` is parsed (never imported) and every import in it is resolved, absolute and
relative, wherever it sits: module top, inside a function, under `TYPE_CHECKING`. A module's layer is its folder, or
the shared level for the files directly in `vflash_core/`; `vflash_core/__init__.py` is the public face that
re-exports names from every layer, so it sits above all of them and nothing inside imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "vflash_core"

# The layers, lowest first; a module may import its own layer and the ones before it. `docs/architecture.md` states
# the same order (`LAYER_ORDER`, checked below).
SHARED = "shared"
LAYERS: tuple[tuple[str, ...], ...] = (
    (SHARED,), ("engine",), ("weights",), ("media",), ("pipeline",), ("cli", "service"),
)
FACADE = "vflash_core"
NODE_PACK = "vflash_nodes"


def _layer_names(layer: tuple[str, ...]) -> str:
    return ", ".join("shared (`vflash_core/*.py`)" if name == SHARED else f"`{name}/`" for name in layer)


LAYER_ORDER = "Layers, lowest first: " + " < ".join(_layer_names(layer) for layer in LAYERS) + "."


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of vflash_core (a package by its `__init__.py`)."""
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported name) of every import in the module: a vflash_core module, or another top-level package."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _owner(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                # `from pkg import name` imports the submodule `pkg.name` when there is one, else a name of `pkg`.
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in MODULES else _owner(base)))
    return found


def _owner(dotted: str) -> str:
    """The vflash_core module that defines `dotted` (its longest known prefix), or the top-level package outside."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return parts[0]


def _layer(module: str) -> int:
    """The index in LAYERS of a vflash_core module below the facade."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 and (CORE / parts[1]).is_dir() else SHARED
    for index, layer in enumerate(LAYERS):
        if folder in layer:
            return index
    raise AssertionError(f"{module}: in no layer of LAYERS ({folder})")


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _upward(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Every import of the node pack, of the package facade from inside, or of a higher layer, one line each."""
    found = set()
    for source, imports in graph.items():
        where = MODULES[source].relative_to(ROOT)
        for line, target in imports:
            if target == NODE_PACK:
                found.add(f"{where}:{line}: imports the node pack {NODE_PACK}")
            elif source == FACADE or target not in MODULES:
                continue
            elif target == FACADE:
                found.add(f"{where}:{line}: imports the package facade {FACADE}")
            elif _layer(target) > _layer(source):
                found.add(f"{where}:{line}: {source} imports {target}, a higher layer")
    return sorted(found)


def _cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module of the import graph (Tarjan, iterative)."""
    edges = {s: sorted({t for _, t in imports if t in MODULES and t != s}) for s, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if child < len(edges[node]):
                work.append((node, child + 1))
                target = edges[node][child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
            if work:  # back in the parent, which this node was a child of
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return components


def test_every_module_has_a_layer_and_imports_resolve():
    assert len(MODULES) > 50 and "vflash_core.engine.session" in MODULES and "vflash_core.errors" in MODULES
    for name in MODULES:
        if name != FACADE:
            _layer(name)
    # Relative forms: a submodule of the package (`from . import model as M`), a name of a sibling module, a name of
    # a module two levels up; and an import inside a function (the options' attention backends).
    assert "vflash_core.engine.model" in {target for _, target in GRAPH["vflash_core.engine.fused"]}
    assert "vflash_core.errors" in {target for _, target in GRAPH["vflash_core.formats"]}
    assert "vflash_core.errors" in {target for _, target in GRAPH["vflash_core.engine.session"]}
    assert "vflash_core.engine.attention" in {target for _, target in GRAPH["vflash_core.pipeline.options"]}


def test_imports_point_down_the_layers():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "\n".join(" <-> ".join(component) for component in cycles)


def test_the_checks_find_what_they_look_for():
    """An import up a layer, of the node pack, of the facade, and a cycle, each added to the real graph, are found."""
    added = {
        "vflash_core.errors": [(1, "vflash_core.fileio")],  # fileio imports errors: a cycle
        "vflash_core.engine.layout": [(2, "vflash_core.media.references")],
        "vflash_core.weights.checkpoint": [(3, NODE_PACK), (4, FACADE)],
    }
    graph = {name: [*imports, *added.get(name, [])] for name, imports in GRAPH.items()}
    assert ["vflash_core.errors", "vflash_core.fileio"] in _cycles(graph)
    assert {
        "vflash_core/engine/layout.py:2: vflash_core.engine.layout imports vflash_core.media.references, a higher layer",
        f"vflash_core/weights/checkpoint.py:3: imports the node pack {NODE_PACK}",
        f"vflash_core/weights/checkpoint.py:4: imports the package facade {FACADE}",
    } <= set(_upward(graph))


def test_architecture_doc_states_the_layer_order():
    assert LAYER_ORDER in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
