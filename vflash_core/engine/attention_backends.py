"""The attention backends' names (`attention.resolve_attention` resolves them to kernels; see its module docstring),
without torch: the command line's parsers and the node pack's menus offer them without importing the engine."""

from __future__ import annotations

__all__ = ["APPROXIMATE_BACKENDS", "BACKENDS", "CPU_BACKENDS", "SDPA_KERNELS"]

#: The backends that pin one of torch's SDPA kernels, by the `torch.nn.attention.SDPBackend` member each pins.
SDPA_KERNELS = {
    "torch-cudnn": "CUDNN_ATTENTION",
    "torch-flash": "FLASH_ATTENTION",
    "torch-efficient": "EFFICIENT_ATTENTION",
    "torch-math": "MATH",
}
APPROXIMATE_BACKENDS = ("fa3-fp8",)
BACKENDS = ("auto", "torch-sdpa", *SDPA_KERNELS, "fa3", *APPROXIMATE_BACKENDS)
CPU_BACKENDS = ("auto", "torch-sdpa", "torch-math")  # what runs on the CPU: the others need a CUDA device
