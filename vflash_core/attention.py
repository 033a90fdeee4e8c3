"""Attention backends: explicit kernel selection for every call.

The default backend reproduces diffusers' `native` attention: `F.scaled_dot_product_attention` on (B, heads, S, D)
permuted views. On CUDA, which SDPA kernel runs depends on a process-wide priority (inside ComfyUI it is flash-first,
a silent 1.6x loss on Hopper), so CUDA backends pin the kernel with `sdpa_kernel` on every call, and an unavailable
explicit choice is an error, never a silent fallback.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import VflashError
from .model import AttentionFn, sdpa_attention

logger = logging.getLogger(__name__)

_SDPA_KERNELS = {
    "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
    "torch-flash": SDPBackend.FLASH_ATTENTION,
    "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "torch-math": SDPBackend.MATH,
}
BACKENDS = ("auto", "torch-sdpa", *_SDPA_KERNELS)


def _pinned_sdpa(kernel: SDPBackend) -> AttentionFn:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([kernel]):
            return sdpa_attention(q, k, v)

    return attend


def resolve_attention(name: str, device: torch.device) -> tuple[str, AttentionFn]:
    """(backend actually used, function) for a requested backend name on `device`."""
    if name not in BACKENDS:
        raise VflashError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if device.type != "cuda":
        if name not in ("auto", "torch-sdpa", "torch-math"):
            raise VflashError(f"attention backend {name} needs a CUDA device, not {device}")
        return "torch-sdpa", sdpa_attention
    if name == "auto":
        name = "torch-cudnn"
    if name == "torch-sdpa":
        return name, sdpa_attention
    kernel = _SDPA_KERNELS[name]
    _probe(name, kernel, device)
    return name, _pinned_sdpa(kernel)


def _probe(name: str, kernel: SDPBackend, device: torch.device) -> None:
    """Fail now, with the backend's name, if the pinned kernel cannot run H3's shapes on this device."""
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16, device=device)
    try:
        with sdpa_kernel([kernel]):
            sdpa_attention(q, q, q)
    except RuntimeError as exc:
        raise VflashError(f"attention backend {name} is not available on {torch.cuda.get_device_name(device)}: {exc}") from None
