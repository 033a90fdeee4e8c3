"""How the Vflash core reaches ComfyUI: progress bars, interrupts, memory cooperation, model folders, core types.

`ComfyHost` implements `ops.Host` with ComfyUI's own hooks only (no patching): progress goes to
`comfy.utils.ProgressBar` (whose server hook also raises on interrupt), interrupts are polled with
`throw_exception_if_processing_interrupted()`, memory is freed with `unload_all_models()` + `soft_empty_cache()`, the
device is `get_torch_device()` read at call time (ComfyUI-MultiGPU patches it), videos are core
`VideoFromComponents`. `ComfyFolders` lists and resolves model files through `folder_paths`. In `vflash
run-workflow` the same classes run over the headless host's modules of those names (`headless/`).
"""

from __future__ import annotations

import logging
import os
from fractions import Fraction

import comfy.model_management as mm
import comfy.nested_tensor
import comfy.utils
import folder_paths
from comfy_api.latest import InputImpl, Types

logger = logging.getLogger("vflash")


class ComfyHost:
    nested = comfy.nested_tensor.NestedTensor

    def progress(self, total: int) -> comfy.utils.ProgressBar:
        return comfy.utils.ProgressBar(total)

    def check_interrupt(self) -> None:
        mm.throw_exception_if_processing_interrupted()

    def free_memory(self) -> None:
        mm.unload_all_models()
        mm.soft_empty_cache()

    def default_device(self) -> str:
        return str(mm.get_torch_device())

    def make_video(self, images, audio, fps: float):
        return InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=audio, frame_rate=Fraction(fps)))

    def log(self, line: str) -> None:
        logger.info(line)


class ComfyFolders:
    def filenames(self, key: str) -> list[str]:
        return folder_paths.get_filename_list(key) if key in folder_paths.folder_names_and_paths else []

    def folders(self, key: str) -> list[str]:
        return folder_paths.get_folder_paths(key) if key in folder_paths.folder_names_and_paths else []

    def full_path(self, key: str, name: str) -> str | None:
        """A file through `get_full_path`; a model folder (diffusers root, compiled output) by the same search,
        which core's `get_full_path` does not do (it finds files only)."""
        found = folder_paths.get_full_path(key, name)
        if found is not None:
            return found
        rel = os.path.relpath(os.path.join("/", name), "/")
        for base in self.folders(key):
            candidate = os.path.join(base, rel)
            if os.path.isdir(candidate):
                return candidate
        return None


HOST = ComfyHost()
FOLDERS = ComfyFolders()
