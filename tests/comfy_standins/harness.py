"""The node pack loaded over its headless host (`vflash_nodes.headless`, what `vflash run-workflow` uses), for tests.

`installed(cache_dir, comfy_dir)` points `VFLASH_CACHE` at `cache_dir`, lays out a ComfyUI-style folder in
`comfy_dir` (`models/`, `input/`, `output/`), loads the pack there and yields a `Pack`; everything is undone after.
`Pack.node_types(prompt)` are the runner's node types, so tests run graphs with the same executor as
`vflash run-workflow`. The pack's core nodes get two test-only ones, `CLIPLoader` and `VAELoader` (`core_loaders.py`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from vflash_nodes.headless import installed as headless
from vflash_nodes.workflow import NodeType, node_types

from . import core_loaders


@dataclass
class Pack:
    nodes: dict[str, type]  # node_id -> class (Vflash nodes only)
    core: dict[str, type]  # node_id -> core stand-in class
    package: ModuleType  # `vflash_nodes`, with this install's `host` and `registry`

    def schema(self, node_id: str):
        return (self.nodes.get(node_id) or self.core[node_id]).GET_SCHEMA()

    def node_types(self, prompt: dict | None = None) -> dict[str, NodeType]:
        return node_types({**self.core, **self.nodes}, prompt)


@contextlib.contextmanager
def installed(cache_dir: Path, comfy_dir: Path) -> Iterator[Pack]:
    previous = os.environ.get("VFLASH_CACHE")
    os.environ["VFLASH_CACHE"] = str(cache_dir)
    folders = [comfy_dir / name for name in ("output", "input", "models")]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        with headless(*folders) as loaded:
            import folder_paths  # this install's

            for key in ("text_encoders", "vae"):  # the stand-ins' one-line JSON files are listed as core lists its models
                folder_paths.folder_names_and_paths[key][1].add(".json")
            core = {**loaded.core, **{cls.GET_SCHEMA().node_id: cls for cls in core_loaders.NODES}}
            yield Pack(loaded.nodes, core, loaded.package)
    finally:
        if previous is None:
            os.environ.pop("VFLASH_CACHE", None)
        else:
            os.environ["VFLASH_CACHE"] = previous
