"""The Vflash engines inside ComfyUI's own memory management (`comfy.model_management`), imported by `host` only where
that module holds models (a real ComfyUI; the headless host has none).

ComfyUI manages the models in `comfy.model_management.current_loaded_models`: `POST /free` (`unload_models`,
`free_memory`), its out-of-memory recovery and every `free_memory(bytes, device)` / `load_models_gpu` of core's own
loaders evict entries of that list. Each loaded Vflash engine (the transformer session, the text encoder, the VAE pair)
is registered there through an `EnginePatcher`, a `comfy.model_patcher.ModelPatcher` (so `isinstance` checks and the
attributes core reads on entries hold) whose weights are the engine's, stated in bytes, and whose unload closes the
engine. ComfyUI-GGUF registers its models the same way (a `ModelPatcher` subclass); its models are core models with
other weight tensors, ours are engines with no `torch` modules core could move, so every method that moves weights
is replaced here:

* `model_size()` / `loaded_size()`: the bytes the engine holds on its device (the transformer's weights as its
  memory plan placed them; the text encoder's and VAEs' as loaded, on the device only where the device is the CPU:
  elsewhere they sit in host memory between their stages and `loaded_size()` is 0);
* `partially_load`: nothing to load (the engine is registered loaded); `partially_unload`: 0 bytes (an engine is
  released whole, so core's `LoadedModel.model_unload` goes on to `detach`);
* `detach`: closes the engine and tells its registry, which forgets it; the next run loads it again.

Registration enters the loaded engine as `load_models_gpu` enters a model it loaded (`register`). Vflash's own
requests go to `free_memory(bytes, device, keep_loaded)`, keeping the engines the next stage runs on, so a sampling is
never evicted by its own request; while the sampling runs its engine is off core's list (`running`), so no load in the
meantime (core's tiny preview decoder) evicts it either. The functions used here have the same signatures and
behaviour in ComfyUI 0.33.0 (`783545f`, run by the tests) and 0.38.1 (read, not run); 0.38.1's `ModelPatcher.__init__`
adds a keyword (`fast_disk`) the patcher leaves at its default.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import comfy.model_management as mm
import comfy.model_patcher
import torch

logger = logging.getLogger("vflash")

__all__ = ["EnginePatcher", "make_room", "register", "running"]


class VflashEngineModel(torch.nn.Module):
    """What core sees as the patcher's model (`ModelPatcher.model`): no tensors of its own; its class names the engine
    in core's log lines ("Requested to load VflashTransformer") and its lifetime bounds the entry (core drops an entry
    whose model was garbage collected)."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label


class VflashTransformer(VflashEngineModel):
    pass


class VflashTextEncoder(VflashEngineModel):
    pass


class VflashVAEs(VflashEngineModel):
    pass


_MODELS = {"dit": VflashTransformer, "te": VflashTextEncoder, "vae": VflashVAEs}


class EnginePatcher(comfy.model_patcher.ModelPatcher):
    """One loaded Vflash engine as an entry of ComfyUI's model management (module docstring). `on_detach` runs once,
    after the engine was closed."""

    def __init__(
        self, kind: str, label: str, engine: Any, device_bytes: int, device: torch.device, on_detach: Callable[[], None]
    ):
        super().__init__(_MODELS[kind](label), device, torch.device("cpu"), size=max(1, device_bytes))
        self.engine = engine
        self.kind = kind
        self.label = label
        self.device_bytes = device_bytes
        self.on_detach: Callable[[], None] | None = on_detach

    @property
    def open(self) -> bool:
        return self.engine is not None and not getattr(self.engine, "closed", False)

    def model_size(self) -> int:
        return self.device_bytes

    def loaded_size(self) -> int:
        return self.device_bytes if self.open else 0

    def current_loaded_device(self) -> torch.device:
        return self.load_device if self.open else self.offload_device

    def model_dtype(self) -> None:
        return None  # an engine has no one weight dtype; core then leaves the patches' dtypes alone

    def partially_load(
        self, device_to: torch.device, extra_memory: float = 0, force_patch_weights: bool = False
    ) -> int:
        return 0

    def partially_unload(
        self, device_to: torch.device, memory_to_free: float = 0, force_patch_weights: bool = False
    ) -> int:
        return 0

    def detach(self, unpatch_all: bool = True) -> torch.nn.Module:
        """Close the engine (core unloads it, or the patcher is collected) and tell its registry, once."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
            logger.info(f"Vflash: {self.label} released through ComfyUI's model management")
        callback, self.on_detach = self.on_detach, None
        if callback is not None:
            callback()
        return self.model


# Core's entries hold their patchers weakly (a node's cached output owns a core model's patcher), and core's unload
# drops its finalizer only after `detach` returned: an engine's patcher must outlive its own unload, so the pack holds
# each one while core lists it, and lets go at its next call after core dropped it.
_LISTED: list[EnginePatcher] = []


def _prune() -> None:
    listed = [entry.model for entry in mm.current_loaded_models]
    _LISTED[:] = [p for p in _LISTED if any(p is model for model in listed)]


def _entries(patchers: Sequence[EnginePatcher]) -> list[Any]:
    """The `LoadedModel` entries of `patchers` in core's list (what `free_memory` takes as `keep_loaded`)."""
    return [entry for entry in mm.current_loaded_models if any(entry.model is p for p in patchers)]


def register(patcher: EnginePatcher) -> None:
    """Enter a loaded engine in core's list, first (the most recently loaded), as `load_models_gpu` enters a model
    once it is loaded (`LoadedModel.model_load`, which here loads nothing). Not `load_models_gpu` itself: Vflash asked
    for its room before loading (`make_room`), and core's call would free memory again and pin host memory for
    weights it would offload, which an engine never hands to core."""
    _prune()
    entry = mm.LoadedModel(patcher)
    entry.model_load()
    mm.current_loaded_models.insert(0, entry)
    _LISTED.append(patcher)


def unregister(patcher: EnginePatcher) -> None:
    """Release an engine the pack lets go of (an unload, `force_offload`, a failure) through core's own unload path,
    which closes it (`detach`) and drops its entry; an engine core already dropped is closed directly."""
    if _entries([patcher]):
        others = [entry for entry in mm.current_loaded_models if entry.model is not patcher]
        mm.free_memory(1e30, patcher.load_device, keep_loaded=others)
    patcher.detach()
    _prune()


@contextlib.contextmanager
def running(patchers: Sequence[EnginePatcher]) -> Iterator[None]:
    """While a stage runs on `patchers`' engines, core's list does not hold them, so a `free_memory` in the meantime
    (a live preview's tiny decoder is loaded by core's `load_models_gpu` during the sampling, protecting only itself)
    cannot close an engine mid-stage: an engine is released whole, never in part as core's own models are. Those
    still open go back first (the most recently used) when the stage ends, however it ends."""
    entries = _entries(patchers)
    for entry in entries:
        mm.current_loaded_models.remove(entry)
    try:
        yield
    finally:
        for entry in reversed(entries):
            patcher = entry.model
            if patcher is not None and patcher.open:
                mm.current_loaded_models.insert(0, entry)
                if not any(p is patcher for p in _LISTED):  # a `_prune` during the stage let go of it
                    _LISTED.append(patcher)


def make_room(needs: Mapping[torch.device, int], keep: Sequence[EnginePatcher]) -> None:
    """Ask core for `needs[device]` free bytes on each device (plus the memory it reserves for other applications,
    `--reserve-vram`): it evicts models, least needed first, only until that much is free, never the engines in `keep`
    (those the next stage runs on)."""
    kept = _entries(keep)
    for device, need in needs.items():
        if need > 0:
            mm.free_memory(need + mm.extra_reserved_memory(), device, keep_loaded=kept)
    _prune()
