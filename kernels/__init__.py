"""Vflash Triton kernels (installed and imported as `vflash_kernels`).

Each op sits beside its PyTorch reference with the identical BF16 rounding contract and a parity test.

| import                                                     | reference                  |
|------------------------------------------------------------|----------------------------|
| `from vflash_kernels.modulate import modulate`             | `modulate_reference`       |
| `from vflash_kernels.gated_residual import gated_residual` | `gated_residual_reference` |
| `from vflash_kernels.rope import rope, qk_norm_rope`       | `rope_reference`, `qk_norm_rope_reference` |
| `from vflash_kernels.swiglu import swiglu`                 | `swiglu_reference`         |
| `from vflash_kernels.relayout import pack_heads, merge_heads` | `pack_heads_reference`, `merge_heads_reference` |

Nothing is re-exported here: an op and its module share a name, and importing this package must stay free of triton
(the ComfyUI entry point registers it on every start, also on machines without triton).
"""
