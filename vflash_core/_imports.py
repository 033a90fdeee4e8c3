"""Importing the sibling `kernels/` folder as `vflash_kernels` when the repository is used unpacked, and a package's
public names loaded on first use (`LazyNames`).

pip installs `kernels/` as the `vflash_kernels` package. When a host application imports the repository from its
folder without a pip install, the folder is registered under that same name from its path; the repository root is never
put on `sys.path`, which would expose the folder as a top-level `kernels` and shadow the PyPI package of that name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def hide_repository_root() -> None:
    """Take the repository root off `sys.path` where Python put it: `python -m vflash_core...` run from a checkout puts
    the working directory first, and there the sibling `kernels/` folder is the top-level `kernels`, which shadows the
    PyPI package of that name that transformers imports (transformers 5 installs it). Nothing is imported from the root
    itself: the packages come from the pip install or are registered by path (`load_package`). A pip-installed core
    has no sibling `kernels/` folder and leaves `sys.path` alone."""
    root = Path(__file__).resolve().parent.parent
    if (root / "kernels" / "__init__.py").is_file():
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]


def load_package(name: str, folder: Path) -> ModuleType:
    """Import `name`, or register `folder` (a package directory) under `name` if it is not importable."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot load {name} from {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def vflash_kernels() -> ModuleType:
    return load_package("vflash_kernels", Path(__file__).resolve().parent.parent / "kernels")


class LazyNames:
    """A package's public names, each imported from its module (`sources`: name -> module relative to the package)
    when first asked for, then kept on the package: its module-level `__getattr__` and `__dir__` call `get` and
    `names`, so importing the package (or any submodule) loads none of them."""

    def __init__(self, package: str, sources: dict[str, str]):
        self.package, self.sources = package, sources

    def get(self, name: str) -> Any:
        if name not in self.sources:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(self.sources[name], self.package), name)
        setattr(sys.modules[self.package], name, value)  # once: later lookups find it without `__getattr__`
        return value

    def names(self) -> list[str]:
        return sorted(set(vars(sys.modules[self.package])) | set(self.sources))

