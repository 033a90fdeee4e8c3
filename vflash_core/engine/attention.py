"""Attention backends: explicit kernel selection for every call.

`torch-sdpa` reproduces diffusers' `native` attention: `F.scaled_dot_product_attention` on (B, heads, S, D) permuted
views. On CUDA, which SDPA kernel runs depends on a process-wide priority (a host application may make it flash-first, a
silent 1.6x loss on Hopper), so CUDA backends pin the kernel with `sdpa_kernel` on every call, and an unavailable
explicit choice is an error, never a silent fallback.

`fa3` is FlashAttention-3's forward kernel (PyPI `fa3-fwd`, SM90 only; `pip install vflash[sm90]`): exact attention
(no sparsity, no quantisation), a different kernel from cuDNN, so its bits differ within bf16 rounding (max abs
difference 2.4e-4 to 4.9e-4 at H3 shapes, measured). `auto` picks it on SM90 when it imports and runs, else cuDNN
(every other GPU family of `formats.ARCH_FAMILIES`: sm80, sm86, sm89, sm100, sm120); `fa3` asked for on another family
is refused before anything imports, naming the device's family.

`fa3-fp8` is approximate: the same package's FP8 forward (its SM90 E4M3 kernels, `flash_attn_func` with per-head
`q_descale` / `k_descale` / `v_descale`), on q, k and v quantized per head (`fp8.quantize_heads`), BF16 out. It is
never picked by `auto`, and only an FP8 profile's session takes it (`approximate_allowed`); where the installed build
has no FP8 kernels or the GPU is not SM90 it is refused, naming why.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import VflashError
from ..formats import ARCH_NAMES, arch_family, device_arch
from .attention_backends import APPROXIMATE_BACKENDS, BACKENDS, CPU_BACKENDS, SDPA_KERNELS
from .model import AttentionFn, sdpa_attention

__all__ = ["resolve_attention"]

logger = logging.getLogger(__name__)
# Devices whose "auto" fallback was logged: the options check, the session and each rank resolve the same choice.
_FALLBACK_LOGGED: set[torch.device] = set()

_SDPA_KERNELS = {name: getattr(SDPBackend, member) for name, member in SDPA_KERNELS.items()}
_FA3_MISSING = "attention backend {} needs the fa3-fwd package (pip install 'vflash[sm90]'): {}"


def _pinned_sdpa(kernel: SDPBackend) -> AttentionFn:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([kernel]):
            return sdpa_attention(q, k, v)

    return attend


def _fa3() -> AttentionFn:
    """FlashAttention-3's `flash_attn_func`: (B, S, heads, D) in and out, scale 1/sqrt(D), non-causal."""
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError as exc:
        raise VflashError(_FA3_MISSING.format("fa3", exc)) from None
    return flash_attn_func


def _fa3_fp8() -> AttentionFn:
    try:
        from fa3_fwd_config import CONFIG
        from fa3_fwd_interface import flash_attn_func
    except ImportError as exc:
        raise VflashError(_FA3_MISSING.format("fa3-fp8", exc)) from None
    if CONFIG.get("build_flags", {}).get("FLASHATTENTION_DISABLE_FP8", True):
        raise VflashError(
            "attention backend fa3-fp8: the installed fa3-fwd was built without FP8 kernels "
            "(FLASHATTENTION_DISABLE_FP8)"
        )
    if not {"q_descale", "k_descale", "v_descale"} <= set(inspect.signature(flash_attn_func).parameters):
        raise VflashError(
            "attention backend fa3-fp8: the installed fa3-fwd's flash_attn_func takes no q/k/v descale factors "
            "(fa3-fwd 0.0.3 does)"
        )
    from .fp8 import quantize_heads

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        (q8, q_descale), (k8, k_descale), (v8, v_descale) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
        return flash_attn_func(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)  # BF16 out

    return attend


def resolve_attention(name: str, device: torch.device, approximate_allowed: bool = False) -> tuple[str, AttentionFn]:
    """(backend actually used, function) for a requested backend name on `device`. An approximate backend
    (`APPROXIMATE_BACKENDS`) is refused unless `approximate_allowed` (an FP8 profile's session)."""
    if name not in BACKENDS:
        raise VflashError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name in APPROXIMATE_BACKENDS and not approximate_allowed:
        raise VflashError(
            f"attention backend {name} is approximate (FP8 attention): "
            "it runs only with an FP8 profile (an id with -fp8-)"
        )
    if device.type != "cuda":
        if name not in CPU_BACKENDS:
            raise VflashError(f"attention backend {name} needs a CUDA device, not {device}")
        return "torch-sdpa", sdpa_attention
    family = arch_family(device)
    if name == "auto":
        if family is not None and family.fa3:
            try:
                fn = _fa3()
                _probe("fa3", fn, device)
                return "fa3", fn
            except VflashError as exc:
                if device not in _FALLBACK_LOGGED:
                    _FALLBACK_LOGGED.add(device)
                    logger.info("attention auto on %s: FlashAttention-3 unavailable (%s); using cuDNN", device, exc)
        name = "torch-cudnn"
    if name == "torch-sdpa":
        return name, sdpa_attention
    if name in ("fa3", "fa3-fp8") and (family is None or not family.fa3):
        kind = "FP8 kernels" if name == "fa3-fp8" else "kernels"
        here = ARCH_NAMES.get(device_arch(device), device_arch(device))
        raise VflashError(
            f"attention backend {name} runs FlashAttention-3's SM90 {kind} only; "
            f"{device} is {here}: use auto (cuDNN there)"
        )
    if name == "fa3":
        fn = _fa3()
    elif name == "fa3-fp8":
        fn = _fa3_fp8()
    else:
        fn = _pinned_sdpa(_SDPA_KERNELS[name])
    _probe(name, fn, device)
    return name, fn


def _probe(name: str, fn: AttentionFn, device: torch.device) -> None:
    """Fail now, with the backend's name, if the kernel cannot run H3's shapes on this device."""
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16, device=device)
    try:
        fn(q, q, q)
    except RuntimeError as exc:
        raise VflashError(
            f"attention backend {name} is not available on {torch.cuda.get_device_name(device)}: {exc}"
        ) from None
