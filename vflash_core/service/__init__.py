"""`vflash serve`: an HTTP generation service whose model work runs in one spawned worker process.

    from vflash_core.service import ServiceConfig, create_app
    web.run_app(create_app(ServiceConfig(prepared_assets, output_dir, RunOptions(device="cuda:0"))), host="127.0.0.1")

The two names load on first use (`__getattr__`): importing a submodule runs this file first, and `vflash serve`'s
parser reads its limits from `service.config` without importing aiohttp or the pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .config import ServiceConfig

__all__ = ["ServiceConfig", "create_app"]

_SOURCES = {"ServiceConfig": ".config", "create_app": ".app"}


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value
