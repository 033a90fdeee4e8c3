"""Vflash ComfyUI nodes (V3 schema). Thin: each node converts widgets, makes one call into `vflash_core.node_ops`
and wraps the result. Imported only inside ComfyUI (or the tests' stand-ins); `vflash_core` never imports this."""

from __future__ import annotations

import os

from comfy_api.latest import ComfyExtension, io

from . import generation, loaders

NODE_CLASSES: list[type[io.ComfyNode]] = [*loaders.NODES, *generation.NODES]


class VflashExtension(ComfyExtension):
    async def on_load(self) -> None:
        """Register models/vflash (compiled artifacts, receipts) with ComfyUI's model folders."""
        import folder_paths

        folder_paths.add_model_folder_path("vflash", os.path.join(folder_paths.models_dir, "vflash"))

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODE_CLASSES)


async def comfy_entrypoint() -> VflashExtension:
    return VflashExtension()
