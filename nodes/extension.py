"""The ComfyUI V3 entry point of the pack: every Vflash node, and the models/vflash folder. Imported only inside
ComfyUI (or over the headless host, `headless/`)."""

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
