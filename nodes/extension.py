"""The ComfyUI V3 entry point of the pack: every Vflash node, and the models/vflash folder. Imported only inside
ComfyUI (or over the headless host, `headless/`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

from . import generation, loaders

NODE_CLASSES: list[type[io.ComfyNode]] = [*loaders.NODES, *generation.NODES]

logger = logging.getLogger(__name__)
# The custom-nodes folders ComfyUI imported the pack from, in import order. Every copy's root `__init__.py` shares this
# module (the packages are registered once, by the first copy), so a second copy finds the first one here.
PACK_FOLDERS: list[Path] = []


def claim_pack_folder(folder: Path) -> bool:
    """Record that ComfyUI imports the pack from `folder` (as ComfyUI names it: a link is not resolved, since two links
    to one checkout load it twice all the same). True for the first folder; for another one a WARNING naming both,
    and False: that copy must register nothing, or ComfyUI would silently take the last copy's nodes."""
    if not PACK_FOLDERS or PACK_FOLDERS[0] == folder:
        PACK_FOLDERS[:1] = [folder]
        return True
    PACK_FOLDERS.append(folder)
    logger.warning(
        "Vflash: the node pack is installed twice: %s is loaded, and the copy in %s is not (its nodes would replace "
        "the first's; ComfyUI still lists the templates of both folders). Remove one of the two from custom_nodes "
        "and restart ComfyUI.", PACK_FOLDERS[0], folder,
    )
    return False


class VflashExtension(ComfyExtension):
    async def on_load(self) -> None:
        """Register models/vflash (compiled artifacts, receipts) with ComfyUI's model folders."""
        import folder_paths

        folder_paths.add_model_folder_path("vflash", os.path.join(folder_paths.models_dir, "vflash"))

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODE_CLASSES)


async def comfy_entrypoint() -> VflashExtension:
    return VflashExtension()
