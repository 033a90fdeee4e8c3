"""`vflash serve`: an HTTP generation service whose model work runs in one spawned worker process.

    from vflash_core.service import ServiceConfig, create_app
    web.run_app(create_app(ServiceConfig(prepared_assets, output_dir, RunOptions(device="cuda:0"))), host="127.0.0.1")
"""

from .app import create_app
from .config import ServiceConfig

__all__ = ["ServiceConfig", "create_app"]
