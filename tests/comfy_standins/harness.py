"""Load the Vflash node pack the way ComfyUI does, over the stand-ins, and run node graphs through it.

`install(base_dir)` puts this folder on `sys.path` (so `comfy`, `comfy_api` and `folder_paths` resolve to the
stand-ins), points `folder_paths` at `base_dir`, imports the repository root `__init__.py` as a package under a
path-derived name (as `nodes.load_custom_node` does; the root is never put on `sys.path`), awaits the extension's
`on_load()` and `get_node_list()`, and returns a `Pack`. `uninstall()` removes all of it again.

`Pack.node_types()` turns the node classes (and the core stand-ins in `core_nodes.py`) into
`vflash_nodes.workflow.NodeType`s, so the tests run graphs with the same executor as `vflash run-workflow`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACK_MODULE = "custom_nodes_x_vflash"
_STANDIN_MODULES = ("comfy", "comfy_api", "folder_paths", "comfy_standins_core_nodes")
# The pack's modules that import ComfyUI (bound to one install's stand-ins, holding its registry): dropped on uninstall.
_COMFY_BOUND = ("vflash_nodes.extension", "vflash_nodes.loaders", "vflash_nodes.generation", "vflash_nodes.host", "vflash_nodes.registry", "vflash_nodes.types")


@dataclass
class Pack:
    module: object
    extension: object
    nodes: dict[str, type]  # node_id -> class (Vflash nodes only)
    core: dict[str, type]  # node_id -> stand-in core node class

    @property
    def package(self):
        """`vflash_nodes`: the node pack's modules (`host`, `registry`, `ops`, ...)."""
        return importlib.import_module("vflash_nodes")

    def schema(self, node_id: str):
        cls = self.nodes.get(node_id) or self.core[node_id]
        return cls.GET_SCHEMA()

    def node_types(self, prompt: dict | None = None) -> dict:
        from vflash_nodes.workflow import NodeType

        io = importlib.import_module("comfy_api.latest").io
        out = {}
        for node_id, cls in {**self.core, **self.nodes}.items():
            schema = cls.GET_SCHEMA()
            inputs, required = {}, set()
            for inp in schema.inputs:
                if isinstance(inp, io.Autogrow.Input):
                    for i, child in enumerate(inp.template.get_all()):
                        inputs[f"{inp.id}.{child.id}"] = child.get_io_type()
                        if i < inp.template.min and not inp.optional:
                            required.add(f"{inp.id}.{child.id}")
                    continue
                if isinstance(inp, io.DynamicCombo.Input):
                    inputs.update(_dynamic_combo_inputs(io, inp, inp.id))
                    if not inp.optional:
                        required.add(inp.id)
                    continue
                inputs[inp.id] = inp.get_io_type()
                if not inp.optional:
                    required.add(inp.id)
            out[node_id] = NodeType(
                class_type=node_id,
                inputs=inputs,
                required=frozenset(required),
                outputs=tuple(o.get_io_type() for o in schema.outputs),
                run=_runner(cls, schema, prompt),
                output_node=schema.is_output_node,
                validate=cls.validate_inputs if "validate_inputs" in vars(cls) else None,  # as ComfyUI: only an override
            )
        return out


def _dynamic_combo_inputs(io, combo, key: str) -> dict[str, str]:
    """A DynamicCombo's API keys: its own ("format") and its options' children, nested ones dotted further
    ("format.codec", "format.codec.encoding", ...)."""
    out = {key: "COMBO"}
    for option in combo.options:
        for child in option.inputs:
            if isinstance(child, io.DynamicCombo.Input):
                out.update(_dynamic_combo_inputs(io, child, f"{key}.{child.id}"))
            else:
                out[f"{key}.{child.id}"] = child.get_io_type()
    return out


def _runner(cls, schema, prompt):
    io = importlib.import_module("comfy_api.latest").io
    autogrow = [i.id for i in schema.inputs if isinstance(i, io.Autogrow.Input)]

    def run(**inputs):
        for group in autogrow:  # ComfyUI passes an empty dict for an autogrow group with no connected inputs
            inputs.setdefault(group, {})
        clone = type(cls.__name__, (cls,), {})
        clone.hidden = io.HiddenHolder(prompt=prompt)
        out = clone.execute(**inputs)
        return tuple(out.args)

    return run


_installed: Pack | None = None
_refs = 0


def install(base_dir: Path) -> Pack:
    global _installed, _refs
    _refs += 1
    if _installed is not None:
        return _installed
    sys.path.insert(0, str(HERE))
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.reset(base_dir)
    spec = importlib.util.spec_from_file_location(PACK_MODULE, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_MODULE] = module
    spec.loader.exec_module(module)
    extension = asyncio.run(module.comfy_entrypoint())
    asyncio.run(extension.on_load())
    classes = asyncio.run(extension.get_node_list())
    core_spec = importlib.util.spec_from_file_location("comfy_standins_core_nodes", HERE / "core_nodes.py")
    core = importlib.util.module_from_spec(core_spec)
    sys.modules["comfy_standins_core_nodes"] = core
    core_spec.loader.exec_module(core)
    _installed = Pack(module, extension, {c.GET_SCHEMA().node_id: c for c in classes}, {c.GET_SCHEMA().node_id: c for c in core.NODES})
    return _installed


def uninstall() -> None:
    global _installed, _refs
    _refs -= 1
    if _refs > 0:
        return
    _installed = None
    for name in list(sys.modules):
        if name == PACK_MODULE or name.startswith(PACK_MODULE + ".") or name.split(".")[0] in _STANDIN_MODULES or name in _COMFY_BOUND:
            del sys.modules[name]
    # `from . import generation` takes the package's attribute when it exists, so the attributes go with the modules.
    package = sys.modules.get("vflash_nodes")
    for name in _COMFY_BOUND:
        with contextlib.suppress(AttributeError):
            delattr(package, name.rpartition(".")[2])
    if str(HERE) in sys.path:
        sys.path.remove(str(HERE))


@contextlib.contextmanager
def installed(cache_dir: Path, comfy_dir: Path) -> Iterator[Pack]:
    """The pack loaded over the stand-ins with `VFLASH_CACHE` at `cache_dir`; engines closed and all undone after."""
    previous = os.environ.get("VFLASH_CACHE")
    os.environ["VFLASH_CACHE"] = str(cache_dir)
    loaded = install(comfy_dir)
    try:
        yield loaded
    finally:
        loaded.package.registry.ENGINES.close()
        uninstall()
        if previous is None:
            os.environ.pop("VFLASH_CACHE", None)
        else:
            os.environ["VFLASH_CACHE"] = previous
