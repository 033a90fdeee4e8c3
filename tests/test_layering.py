"""The packages and the layers of `vflash_core` import only downward and no two modules import each other, read from
the source.

Every `.py` file of the three packages (`kernels/` as `vflash_kernels`, `vflash_core/`, `nodes/` as `vflash_nodes`) is
parsed (never imported) and every import in it is resolved, absolute and relative, wherever it sits: module top,
inside a function, under `TYPE_CHECKING`. The packages stack: the kernels are a leaf (torch and triton only), the core
sits on them (importing them lazily), the node pack on the core. Inside the core a module's layer is its folder, or
the shared level for the files directly in `vflash_core/`; `vflash_core/__init__.py` is the public face that
re-exports names from every layer, so it sits above all of them and nothing inside imports it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "vflash_core"
KERNELS = "vflash_kernels"
FACADE = "vflash_core"
NODE_PACK = "vflash_nodes"
# The packages by their installed names, lowest first, and their folders; a package imports itself and the ones before
# it. `docs/architecture.md` states the same order (`PACKAGE_ORDER`, checked below).
PACKAGES = {KERNELS: ROOT / "kernels", FACADE: CORE, NODE_PACK: ROOT / "nodes"}

# The layers, lowest first; a module may import its own layer and the ones before it. `docs/architecture.md` states
# the same order (`LAYER_ORDER`, checked below).
SHARED = "shared"
LAYERS: tuple[tuple[str, ...], ...] = (
    (SHARED,), ("engine",), ("weights",), ("media",), ("pipeline",), ("cli", "service"),
)


def _layer_names(layer: tuple[str, ...]) -> str:
    return ", ".join("shared (`vflash_core/*.py`)" if name == SHARED else f"`{name}/`" for name in layer)


LAYER_ORDER = "Layers, lowest first: " + " < ".join(_layer_names(layer) for layer in LAYERS) + "."
PACKAGE_ORDER = "Packages, lowest first: " + " < ".join(
    f"`{folder.name}/` (`{name}`)" if folder.name != name else f"`{name}/`" for name, folder in PACKAGES.items()
) + "."


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the packages, by installed name (a package by its `__init__.py`)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported name) of every import in the module: a module of the packages, or another top-level package."""
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
    """The module of the packages that defines `dotted` (its longest known prefix), or the top-level package outside."""
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


def _package(module: str) -> str:
    return module.split(".")[0]


def _rank(module: str) -> tuple[int, int]:
    """Where a module sits: its package's index in PACKAGES, then its layer inside the core (the facade above all of
    them; the kernels and the node pack have no layers inside)."""
    package = _package(module)
    if package != FACADE:
        return list(PACKAGES).index(package), 0
    return list(PACKAGES).index(package), len(LAYERS) if module == FACADE else _layer(module)


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _upward(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Every import of a higher package, of the core's facade from inside the core, or of a higher layer of the core,
    one line each."""
    found = set()
    for source, imports in graph.items():
        where = MODULES[source].relative_to(ROOT)
        for line, target in imports:
            if target not in MODULES or target == source:
                continue
            if _package(target) != _package(source):
                if _rank(target) > _rank(source):
                    found.add(f"{where}:{line}: {source} imports {target}, of the higher package {_package(target)}")
            elif target == FACADE:
                found.add(f"{where}:{line}: imports the package facade {FACADE}")
            elif _rank(target) > _rank(source):
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
    assert {"vflash_kernels", "vflash_kernels.modulate", "vflash_nodes", "vflash_nodes.workflow"} <= set(MODULES)
    for name in MODULES:
        _rank(name)
    # Relative forms: a submodule of the package (`from . import model as M`), a name of a sibling module, a name of
    # a module two levels up; and an import inside a function (the options' attention backends).
    assert "vflash_core.engine.model" in {target for _, target in GRAPH["vflash_core.engine.fused"]}
    assert "vflash_core.errors" in {target for _, target in GRAPH["vflash_core.formats"]}
    assert "vflash_core.errors" in {target for _, target in GRAPH["vflash_core.engine.session"]}
    assert "vflash_core.engine.attention" in {target for _, target in GRAPH["vflash_core.pipeline.options"]}
    # Across the packages: a kernel's private helpers, the core's lazy import of a kernel, the node pack's of the core.
    assert "vflash_kernels._device" in {target for _, target in GRAPH["vflash_kernels.modulate"]}
    assert "vflash_kernels.modulate" in {target for _, target in GRAPH["vflash_core.engine.fused"]}
    node_pack_targets = {target for source in MODULES if _package(source) == NODE_PACK for _, target in GRAPH[source]}
    assert "vflash_core.errors" in node_pack_targets


def test_imports_point_down_the_layers():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "\n".join(" <-> ".join(component) for component in cycles)


def test_the_checks_find_what_they_look_for():
    """An import up a layer, of the node pack, of the facade, of the core or the node pack from a kernel, and a cycle,
    each added to the real graph, are found."""
    added = {
        "vflash_core.errors": [(1, "vflash_core.fileio")],  # fileio imports errors: a cycle
        "vflash_core.engine.layout": [(2, "vflash_core.media.references")],
        "vflash_core.weights.checkpoint": [(3, NODE_PACK), (4, FACADE)],
        "vflash_kernels.modulate": [(5, "vflash_core.engine.model"), (6, "vflash_nodes.registry")],
    }
    graph = {name: [*imports, *added.get(name, [])] for name, imports in GRAPH.items()}
    assert ["vflash_core.errors", "vflash_core.fileio"] in _cycles(graph)
    assert {
        "vflash_core/engine/layout.py:2: vflash_core.engine.layout imports vflash_core.media.references, a higher layer",
        (f"vflash_core/weights/checkpoint.py:3: vflash_core.weights.checkpoint imports {NODE_PACK}, of the higher "
         f"package {NODE_PACK}"),
        f"vflash_core/weights/checkpoint.py:4: imports the package facade {FACADE}",
        ("kernels/modulate.py:5: vflash_kernels.modulate imports vflash_core.engine.model, of the higher package "
         "vflash_core"),
        ("kernels/modulate.py:6: vflash_kernels.modulate imports vflash_nodes.registry, of the higher package "
         "vflash_nodes"),
    } <= set(_upward(graph))


def test_architecture_doc_states_the_layer_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert LAYER_ORDER in text and PACKAGE_ORDER in text


# -- the test suite: test modules share code through helper modules, never through each other ------------------------

TESTS = ROOT / "tests"
_TEST_MODULE_IMPORT = re.compile(r"^\s*(?:from\s+(test_\w+)\s+import|import\s+(test_\w+))", re.MULTILINE)


def _test_module_imports(source: str) -> list[str]:
    """The test modules `source` imports, in its own code or in the code it hands a child interpreter as a string."""
    return [from_name or plain for from_name, plain in _TEST_MODULE_IMPORT.findall(source)]


def test_no_test_module_imports_another():
    """What test files share lives in helper modules (`tests/kernel_harness.py`, `tests/service_helpers.py`, ...) and
    conftest.py; a test module imported by another runs its module code twice and drags its imports along."""
    found = [
        f"{path.relative_to(ROOT)}: imports {name}"
        for path in sorted(TESTS.glob("*.py"))
        if path.name != Path(__file__).name
        for name in _test_module_imports(path.read_text(encoding="utf-8"))
    ]
    assert not found, "\n".join(found)


def test_the_test_module_check_finds_what_it_looks_for():
    child = 'CHILD = """\nimport sys\nfrom test_kernels import randn\n"""\n'
    source = "import test_service\nfrom kernel_harness import randn\n    from test_nodes import run  # in a function\n"
    assert _test_module_imports(source + child) == ["test_service", "test_nodes", "test_kernels"]
