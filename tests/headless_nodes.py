"""Running the example API workflows through the node pack in the headless host (the `pack` fixture of conftest.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

from vflash_nodes.workflow import execute

API = Path(__file__).resolve().parent.parent / "workflows" / "api"


def run(pack, workflow, on_node=None):
    return execute(workflow, pack.node_types(workflow), on_node=on_node)


def output_dir() -> Path:
    return Path(importlib.import_module("folder_paths").get_output_directory())
