"""How the Vflash core reaches ComfyUI: progress bars, interrupts, memory cooperation, model folders, core types.

`ComfyHost` implements `interfaces.Host` with ComfyUI's own hooks only (no patching): progress goes to
`comfy.utils.ProgressBar` (whose server hook also raises on interrupt), live previews through core's `latent_preview`
previewers for core's MiniMax-H3 video latent format, interrupts are polled with
`throw_exception_if_processing_interrupted()`, the engines are entries of core's model management
(`comfy_memory`: core's Unload, `/free` and its eviction release them, and Vflash asks `free_memory` for the bytes its
next load or stage needs instead of unloading everything), the device is `get_torch_device()` read at call time
(ComfyUI-MultiGPU patches it), videos are core `VideoFromComponents`. `ComfyFolders` (`interfaces.Folders`) lists and
resolves model files through `folder_paths`. In `vflash run-workflow` the same classes run over the headless host's
modules of those names (`headless/`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import comfy.model_management as mm
import comfy.nested_tensor
import comfy.utils
import folder_paths
import torch
from comfy_api.latest import InputImpl, Types

from vflash_core.memory_plan import cap_leaving_free
from vflash_core.progress import preview_strip

from .interfaces import LatentRGB

logger = logging.getLogger("vflash")

_missing_preview_logged: list[str] = []  # each reason previews are off, logged once per process
_memory_logged: list[bool] = []  # the memory management the engines are held in, logged once per process


def _previews_off(reason: str) -> None:
    if reason not in _missing_preview_logged:
        _missing_preview_logged.append(reason)
        logger.info(f"Vflash: no live previews ({reason})")


class ComfyHost:
    nested = comfy.nested_tensor.NestedTensor

    def progress(self, total: int) -> comfy.utils.ProgressBar:
        return comfy.utils.ProgressBar(total)

    def check_interrupt(self) -> None:
        mm.throw_exception_if_processing_interrupted()

    def preview(
        self, total: int, device: torch.device, channels: int, latent_rgb: LatentRGB | None = None
    ) -> Callable[[int, int, torch.Tensor], None] | None:
        """A per-evaluation callback (`vflash_core.progress.PreviewFn`) that draws the x0 prediction of video
        latents with `channels` channels with core's previewer for the user's preview method (`--preview-method`, or
        the prompt's) and sends it with the step's progress on a fresh progress bar, checking for an interrupt.
        Latents of another channel count than core's MiniMax-H3 video format (the demo's 8) are drawn by core's
        latent-to-RGB previewer with the model's own `latent_rgb`. None when the method is "none", or (said once in
        the log) when the running core has no `latent_preview` or no MiniMax-H3 video latent format, or the latents
        are not that format's and the model has no `latent_rgb` of their channels."""
        try:
            import latent_preview
            from comfy import latent_formats
        except ImportError:
            _previews_off("this host has no latent_preview or comfy.latent_formats module")
            return None
        latent_format = getattr(latent_formats, "MiniMaxH3Video", None)
        if latent_format is None:
            _previews_off(
                "this ComfyUI has no MiniMaxH3Video latent format in comfy.latent_formats; update ComfyUI for them"
            )
            return None
        video_format = latent_format()
        if channels != latent_format.latent_channels:
            if latent_rgb is None or len(latent_rgb[0]) != channels:
                _previews_off(
                    f"the model's video latents have {channels} channels, "
                    f"core's MiniMaxH3Video format {latent_format.latent_channels}"
                )
                return None
            # Core's format with the model's own colours and no tiny decoder (core's taeh3 decodes 24 channels).
            video_format.latent_channels = channels
            video_format.latent_rgb_factors, video_format.latent_rgb_factors_bias = latent_rgb
            video_format.taesd_decoder_name = None
        previewer = latent_preview.get_previewer(device, video_format)
        if previewer is None:
            return None
        bar = comfy.utils.ProgressBar(total)

        def show(done: int, total: int, video: torch.Tensor) -> None:
            self.check_interrupt()
            # The projection (latent2rgb) or the tiny decoder runs on the strip on the device; the one copy to the
            # host is core's, of the small uint8 image.
            bar.update_absolute(done, total, previewer.decode_latent_to_preview_image("JPEG", preview_strip(video)))

        return show

    def _memory(self):
        """`comfy_memory` where this ComfyUI's model management holds models (`current_loaded_models`), else None
        (the headless host has no models of its own: the pack's registry alone holds its engines there)."""
        if not hasattr(mm, "current_loaded_models"):
            return None
        from . import comfy_memory

        return comfy_memory

    def hold(
        self,
        kind: str,
        label: str,
        engine: Any,
        device_bytes: int,
        device: torch.device,
        on_release: Callable[[], None],
    ) -> _Held | _CoreHeld:
        memory = self._memory()
        if not _memory_logged:
            _memory_logged.append(True)
            logger.info(
                "Vflash: engines are entries of ComfyUI's model management (Unload, /free and core's eviction close "
                "them; Vflash asks free_memory for the bytes of each load and stage)"
                if memory is not None
                else "Vflash: this host has no model management of its own; the node pack's registry holds the engines"
            )
        if memory is None:
            return _Held(engine, on_release)
        patcher = memory.EnginePatcher(kind, label, engine, device_bytes, torch.device(device), on_release)
        memory.register(patcher)
        return _CoreHeld(memory, patcher)

    def make_room(self, needs: Mapping[torch.device, int], keep: Sequence[Any] = ()) -> None:
        memory = self._memory()
        if memory is None:  # nothing of the host's to release: hand this process's cached blocks back to the driver
            mm.soft_empty_cache()
            return
        memory.make_room(
            {torch.device(d): n for d, n in needs.items()}, [h.patcher for h in keep if isinstance(h, _CoreHeld)]
        )

    def running(self, held: Sequence[Any]) -> contextlib.AbstractContextManager:
        memory = self._memory()
        if memory is None:  # the pack's registry alone holds the engines: nothing else releases them
            return contextlib.nullcontext()
        return memory.running([h.patcher for h in held if isinstance(h, _CoreHeld)])

    def default_device(self) -> str:
        return str(mm.get_torch_device())

    def device_cap_gib(self, device: str) -> float | None:
        """The card less what core keeps free on it for other software (`--reserve-vram`, else core's default
        reserve): what Vflash's engines may hold there. None off CUDA, or where this host reserves nothing (the
        headless host has no such setting)."""
        reserved = getattr(mm, "extra_reserved_memory", None)
        if reserved is None or torch.device(device).type != "cuda":
            return None
        return cap_leaving_free(device, reserved())

    def make_video(self, images, audio, fps: float):
        return InputImpl.VideoFromComponents(
            Types.VideoComponents(images=images, audio=audio, frame_rate=Fraction(fps))
        )

    def log(self, line: str) -> None:
        logger.info(line)


class _Held:
    """An engine held by the pack alone (a host without model management): releasing closes it."""

    def __init__(self, engine: Any, on_release: Callable[[], None]):
        self.engine: Any = engine
        self.on_release: Callable[[], None] | None = on_release

    def release(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
        callback, self.on_release = self.on_release, None
        if callback is not None:
            callback()


class _CoreHeld:
    """An engine held as an entry of core's model management (`comfy_memory.EnginePatcher`)."""

    def __init__(self, memory: Any, patcher: Any):
        self.memory = memory
        self.patcher = patcher

    def release(self) -> None:
        self.memory.unregister(self.patcher)


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
