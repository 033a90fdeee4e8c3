"""Vflash Triton kernels (installed and imported as `vflash_kernels`).

Each op reproduces, bit for bit, a torch operation of the model, which is its reference (one reference per op, where
the model is defined; the video VAE decoder's in `vflash_core.media.vae_vit`, whose SwiGLU is `swiglu.swiglu`'s);
its parity tests compare the two.

| op of `vflash_kernels`                        | reference in `vflash_core.engine`                                 |
|-----------------------------------------------|-------------------------------------------------------------------|
| `modulate.modulate`                           | `model.modulate`                                                  |
| `rms_norm_modulate.rms_norm_modulate`         | `model.rms_norm_modulate`                                         |
| `gated_residual.gated_residual`               | `model.gated_residual`                                            |
| `rope.rope`, `rope.qk_norm_rope`              | `model.rope`, `model.qk_norm_rope`                                |
| `swiglu.swiglu`                               | `model.swiglu`                                                    |
| `relayout.pack_heads`, `relayout.merge_heads` | `parallel.pack_heads_reference`, `parallel.merge_heads_reference` |
| `vae_decoder.rms_norm_cast`                   | `media.vae_vit.DecoderOps.norm`                                   |
| `vae_decoder.head_rms_norm_rope`              | `media.vae_vit.DecoderOps.head_norm_rope`                         |
| `vae_decoder.scaled_residual`                 | `media.vae_vit.DecoderOps.scaled_residual`                        |
| `fp8_quantize.quantize_rows`                  | `fp8.quantize_rows` (approximate FP8 path only, as the two below) |
| `fp8_quantize.swiglu_quantize`                | `fp8.quantize_rows` of `model.swiglu`                             |
| `fp8_quantize.rms_norm_modulate_quantize`     | `fp8.quantize_rows` of `model.rms_norm_modulate`                  |

One kernel is approximate by design and has no bitwise reference: `block_sparse_attention.block_sparse_attention`
(the `sparse-attention` fast mode) is compared, within bf16 rounding, with `sparse_attention.masked_attention`, dense
attention masked to the same key blocks. The blocks it attends come from `block_selection.rank_key_blocks`, which
gives `sparse_attention.rank_key_blocks_reference`'s lists wherever the mass sums are exact; otherwise the two sum in
other orders, and a block whose mass above lands within fp32 rounding of the threshold can be kept by one only.

The package is a leaf: it imports torch and triton, nothing of `vflash_core` or the node pack (tests/test_layering.py
checks it). What a kernel needs of the model's definitions comes in as arguments: the fused ops pass the AdaLN
tables' layout (`vflash_core.engine.model.MODULATION_BLOCKS`) as block positions. The core imports the kernels only
lazily, when a fused op is first built (`engine/fused.py`, `fp8.py`, `parallel.py`, `sparse_attention.py`,
`media/vae_vit.py`). The torch emulations of torch's CUDA RMSNorm order that the parity tests compare the norms
with live beside those tests (tests/kernel_references.py); the `@triton.jit` helpers the kernels share, in `_device`.

Nothing is re-exported here: an op and its module share a name, and importing this package must stay free of triton
(the ComfyUI entry point registers it on every start, also on machines without triton).
"""
