"""The headless host: the part of ComfyUI's interface the node pack needs, so `vflash run-workflow` (and the tests)
import and run the real V3 node classes without ComfyUI.

* `comfy_api.py`, `comfy_io.py`: `comfy_api.latest` (`ComfyExtension`, `io`, `InputImpl`, `Types`);
* `comfy_runtime.py`: `comfy.utils`, `comfy.model_management`, `comfy.nested_tensor`;
* `folder_paths.py`: `folder_paths` over one models folder and the input and output folders;
* `core_nodes.py`: the core nodes the example workflows use.

Importing this package changes nothing. `installed()` puts those modules into `sys.modules` under ComfyUI's names for
the length of a `with` block, imports the node pack's ComfyUI modules (`extension`, `loaders`, `generation`, `host`,
`registry`, `types`) against them, and on exit removes all of it and puts back what was there before (an outer
install's modules: installs nest). It refuses to run in a process where ComfyUI's own modules are loaded, so inside
ComfyUI the node pack only ever sees ComfyUI's real modules. No folder is added to `sys.path`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vflash_core.errors import VflashError

if TYPE_CHECKING:
    from .comfy_io import ComfyNode

# The node pack's modules that import ComfyUI's when they load: bound to one install, so loaded anew for each.
_COMFY_BOUND = ("extension", "loaders", "generation", "host", "registry", "types")


@dataclass
class Loaded:
    """One install: the Vflash node classes and the core stand-ins by node id, and the `vflash_nodes` package,
    whose `host` and `registry` modules are this install's."""

    nodes: dict[str, type[ComfyNode]]
    core: dict[str, type[ComfyNode]]
    package: types.ModuleType


def _fresh(name: str) -> types.ModuleType:
    """A new copy of one of this package's modules (its state, e.g. the interrupt flag, is the install's own)."""
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    assert spec is not None and spec.loader is not None, f"{name} is one of this package's own modules"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(name: str, **children: types.ModuleType) -> types.ModuleType:
    module = types.ModuleType(name, f"The headless host's `{name}` (vflash_nodes.headless).")
    module.__path__ = []  # a package: its submodules are the sys.modules entries installed beside it
    module.__dict__.update(children, VFLASH_HEADLESS=True)
    return module


def _by_id(classes: list[type[ComfyNode]]) -> dict[str, type[ComfyNode]]:
    return {cls.GET_SCHEMA().node_id: cls for cls in classes}


@contextlib.contextmanager
def installed(output_dir: str | Path, input_dir: str | Path, models_dir: str | Path | None = None) -> Iterator[Loaded]:
    """The node pack loaded over the headless host with these folders; its engines are closed on exit."""
    present = sys.modules.get("comfy_api")
    if present is not None and not getattr(present, "VFLASH_HEADLESS", False):
        raise VflashError(
            "ComfyUI is loaded in this process; queue the workflow in ComfyUI instead of running it headless"
        )
    runtime, folders = _fresh("comfy_runtime"), _fresh("folder_paths")
    folders.configure(str(output_dir), str(input_dir), None if models_dir is None else str(models_dir))
    api = importlib.import_module(f"{__name__}.comfy_api")
    modules = {
        "comfy": _package("comfy", utils=runtime, model_management=runtime, nested_tensor=runtime),
        "comfy.utils": runtime, "comfy.model_management": runtime, "comfy.nested_tensor": runtime,
        "comfy_api": _package("comfy_api", latest=api), "comfy_api.latest": api, "folder_paths": folders,
    }
    bound = [f"vflash_nodes.{name}" for name in _COMFY_BOUND]
    package = importlib.import_module("vflash_nodes")
    # `from . import loaders` takes the package's attribute when it exists, so the attributes go with the modules.
    saved = {name: sys.modules.pop(name) for name in [*modules, *bound] if name in sys.modules}
    saved_attributes = {name: vars(package).pop(name) for name in _COMFY_BOUND if name in vars(package)}
    sys.modules.update(modules)
    try:
        extension = asyncio.run(importlib.import_module("vflash_nodes.extension").comfy_entrypoint())
        if models_dir is not None:  # it registers models/vflash; without a models folder there is none
            asyncio.run(extension.on_load())
        loaded = Loaded(_by_id(asyncio.run(extension.get_node_list())), _by_id(_fresh("core_nodes").NODES), package)
        try:
            yield loaded
        finally:
            package.registry.ENGINES.release()
    finally:
        for name in [*modules, *bound]:
            sys.modules.pop(name, None)
        for name in _COMFY_BOUND:
            vars(package).pop(name, None)
        sys.modules.update(saved)
        vars(package).update(saved_attributes)
