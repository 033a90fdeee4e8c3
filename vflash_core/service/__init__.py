"""`vflash serve`: an HTTP generation service whose model work runs in one spawned worker process.

    from vflash_core.service import ServiceConfig, create_app
    web.run_app(create_app(ServiceConfig(prepared_assets, output_dir, RunOptions(device="cuda:0"))), host="127.0.0.1")

The two names load on first use (`__getattr__`): importing a submodule runs this file first, and `vflash serve`'s
parser reads its limits from `service.config` without importing aiohttp or the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._imports import LazyNames

if TYPE_CHECKING:
    from .app import create_app
    from .config import ServiceConfig

__all__ = ["ServiceConfig", "create_app"]

_SOURCES = {"ServiceConfig": ".config", "create_app": ".app"}


_LAZY = LazyNames(__name__, _SOURCES)


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.names()
