"""`comfy.utils`, `comfy.model_management` and `comfy.nested_tensor` for the headless host, in one module: the
progress hook, the interrupt flag, the device and memory calls, and the nested latent the Vflash nodes use.

Installed under all three names; each install gets a fresh copy, so its hook and interrupt flag are its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

# -- comfy.utils: the global hook every ProgressBar reports to (ComfyUI's server sends it to the browser) ----------

PROGRESS_BAR_HOOK: Callable[..., None] | None = None
# ComfyUI throttles updates: the first, the last and previews always go out, others 100 ms and 0.5 % apart.
PROGRESS_THROTTLE_MIN_INTERVAL = 0.1
PROGRESS_THROTTLE_MIN_PERCENT = 0.5


def set_progress_bar_global_hook(function: Callable[..., None] | None) -> None:
    global PROGRESS_BAR_HOOK
    PROGRESS_BAR_HOOK = function


class ProgressBar:
    def __init__(self, total: int, node_id: str | None = None):
        self.total, self.current, self.node_id, self.hook = total, 0, node_id, PROGRESS_BAR_HOOK
        self._last_time, self._last_sent = 0.0, -1

    def update_absolute(self, value: int, total: int | None = None, preview: object = None) -> None:
        self.total = self.total if total is None else total
        self.current = value = min(value, self.total)
        if self.hook is None:
            return
        now = time.perf_counter()
        percent = (value - max(0, self._last_sent)) / self.total * 100 if self.total > 0 else 100
        if (
            preview is not None or self._last_sent < 0 or value >= self.total
            or (now - self._last_time >= PROGRESS_THROTTLE_MIN_INTERVAL and percent >= PROGRESS_THROTTLE_MIN_PERCENT)
        ):
            self.hook(value, self.total, preview, node_id=self.node_id)
            self._last_time, self._last_sent = now, value


# -- comfy.model_management: interrupts (a BaseException, as in ComfyUI), device, memory ----------------------------


class InterruptProcessingException(BaseException):
    pass


_interrupt = False
_mutex = threading.RLock()


def interrupt_current_processing(value: bool = True) -> None:
    global _interrupt
    with _mutex:
        _interrupt = value


def throw_exception_if_processing_interrupted() -> None:
    global _interrupt
    with _mutex:
        if _interrupt:
            _interrupt = False
            raise InterruptProcessingException()


def get_torch_device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def unload_all_models() -> None:
    """No models of the host's own to unload headless."""


def soft_empty_cache(force: bool = False) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- comfy.nested_tensor -------------------------------------------------------------------------------------------


class NestedTensor:
    """ComfyUI's H3 AV latent: the video and audio tensors of one sample (`comfy_latent` reads `.tensors`)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    @property
    def shape(self) -> torch.Size:
        return self.tensors[0].shape
