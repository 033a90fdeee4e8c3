"""Vflash Triton kernels (installed and imported as `vflash_kernels`).

Each op reproduces, bit for bit, a torch operation of the model, which is its reference (one reference per op, where
the model is defined); its parity tests compare the two.

| import                                                        | reference                                          |
|---------------------------------------------------------------|----------------------------------------------------|
| `from vflash_kernels.modulate import modulate`                | `vflash_core.engine.model.modulate`                       |
| `from vflash_kernels.rms_norm_modulate import rms_norm_modulate` | `vflash_core.engine.model.rms_norm_modulate`           |
| `from vflash_kernels.gated_residual import gated_residual`    | `vflash_core.engine.model.gated_residual`                 |
| `from vflash_kernels.rope import rope, qk_norm_rope`          | `vflash_core.engine.model.rope`, `vflash_core.engine.model.qk_norm_rope` |
| `from vflash_kernels.swiglu import swiglu`                    | `vflash_core.engine.model.swiglu`                         |
| `from vflash_kernels.relayout import pack_heads, merge_heads` | `vflash_core.engine.parallel.pack_heads_reference`, `merge_heads_reference` |
| `from vflash_kernels.fp8_quantize import quantize_rows, swiglu_quantize, rms_norm_modulate_quantize` | `vflash_core.engine.fp8.quantize_rows` of the input, of `swiglu`, of `rms_norm_modulate` (approximate FP8 path only) |

The kernels import the model's definitions they share with it (the AdaLN tables' layout, `MODULATION_BLOCKS`)
from `vflash_core.engine.model`; the core imports the kernels only lazily, when a fused op is first built
(`engine/fused.py`, `fp8.py`, `parallel.py`).

Nothing is re-exported here: an op and its module share a name, and importing this package must stay free of triton
(the ComfyUI entry point registers it on every start, also on machines without triton).
"""
