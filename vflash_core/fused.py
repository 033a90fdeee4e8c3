"""GPU fast path: the reference block (`model.main_block`) with its elementwise work in fused Triton kernels.

Same operations, same order, same BF16 roundings as the reference — each kernel reproduces the rounding of the torch
ops it replaces (see `kernels/`) — so a trajectory through this path equals the reference path bit for bit on the
same GPU. What changes is traffic: the AdaLN rows are read from the table by row index inside the kernels instead of
six gathered (S, H) tensors per block, modulation and gated residuals are one pass each (the residual update in
place), rotary writes the attention layout directly, and SwiGLU reads the fused FFN input once.

The 5376-wide RMSNorm is `F.rms_norm` unless `FUSED_NORM_MODULATE` (a kernel summing squares in the order of torch's
vectorized CUDA kernel, enabled only where the GPU test shows it reproduces those bits).
The per-head QK norm (128 channels) is fused with rotary: its kernel sums squares in the order of torch's vectorized
CUDA RMSNorm, and the GPU test shows it reproduces `F.rms_norm` (`FUSED_QK_NORM`).
"""

from __future__ import annotations

import torch

from . import model as M
from ._imports import vflash_kernels
from .config import H3Config
from .profiler import StageTimer

# Whether the fused QK RMSNorm + rotary kernel replaces F.rms_norm + rotary. Measured on an H200 (torch 2.11, triton
# 3.6, 2026-11-30): 0 differing elements against F.rms_norm + rotary at S = 19,796, 38,222 and 100,000, full width
# (tests/test_kernels.py, GPU); 0.42 / 0.81 ms instead of 5.9 / 11.3 ms per block. Re-check after a torch upgrade.
FUSED_QK_NORM = True
# Whether the 5376-wide RMSNorm and the AdaLN modulation run as one kernel (`rms_norm_modulate`, torch's reduction
# order for its vectorized CUDA RMSNorm) instead of `F.rms_norm` + `modulate`. Measured on an H200 (torch 2.11,
# triton 3.6, 2026-11-30): 0 of 106,423,296 / 205,481,472 elements differ at S = 19,796 / 38,222 for both halves
# (tests/test_rms_norm_modulate.py, GPU); 0.177 / 0.345 ms instead of 0.244 / 0.462 ms. Re-check after a torch upgrade.
FUSED_NORM_MODULATE = True


class FusedBlock:
    """`block_fn` for `Denoiser`: one main block with Triton elementwise kernels and stage timing."""

    def __init__(self, config: H3Config, attention: M.AttentionFn):
        vflash_kernels()
        from vflash_kernels.gated_residual import gated_residual
        from vflash_kernels.modulate import modulate
        from vflash_kernels.rms_norm_modulate import rms_norm_modulate
        from vflash_kernels.rope import qk_norm_rope, rope
        from vflash_kernels.swiglu import swiglu

        self.config = config
        self.attention = attention
        self.modulate, self.gated_residual, self.rope, self.qk_norm_rope, self.swiglu = modulate, gated_residual, rope, qk_norm_rope, swiglu
        self.rms_norm_modulate = rms_norm_modulate

    def norm_modulate(self, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, which: str) -> torch.Tensor:
        """RMSNorm then AdaLN modulation of the (1, S, H) stream: one kernel or two (`FUSED_NORM_MODULATE`)."""
        if FUSED_NORM_MODULATE:
            return self.rms_norm_modulate(x, weight, self.config.norm_eps, table, idx, which)
        return self.modulate(M.rms_norm(x, weight, self.config.norm_eps), table, idx, which)

    def __call__(self, x: torch.Tensor, w: M.LayerWeights, table: torch.Tensor, plan, state, timer: StageTimer) -> torch.Tensor:
        """x: (1, S, H) residual stream, updated in place and returned."""
        cfg, idx = self.config, plan.adaln_indices
        cos, sin = state.rotary
        with timer.stage("adaln_modulation"):
            h = self.norm_modulate(x, w["norm1.weight"], table, idx, "msa")
        with timer.stage("qkv_projection"):
            qkv = M.linear(h, w["attn.qkv.weight"], loras=w.lora("attn.qkv"))
        with timer.stage("qk_norm_rope"):
            if FUSED_QK_NORM:
                q, k, v = self.qk_norm_rope(qkv, w["attn.norm_q.weight"], w["attn.norm_k.weight"], cfg.qk_norm_eps, cos, sin, head_dim=cfg.attention_head_dim)
            else:
                q, k, v = (part.unflatten(-1, (cfg.num_attention_heads, -1)) for part in qkv.split(cfg.inner_dim, dim=-1))
                q, k = self.rope(M.rms_norm(q, w["attn.norm_q.weight"], cfg.qk_norm_eps), M.rms_norm(k, w["attn.norm_k.weight"], cfg.qk_norm_eps), cos, sin)
        del qkv, h
        with timer.stage("attention"):
            out = self.attention(q, k, v).flatten(2, 3).type_as(q)
        del q, k, v
        with timer.stage("attention_output"):
            y = M.linear(out, w["attn.out.weight"], loras=w.lora("attn.out"))
            del out
            self.gated_residual(x, y, table, idx, "msa", inplace=True)
        del y
        with timer.stage("ffn_norm_modulation"):
            h = self.norm_modulate(x, w["norm2.weight"], table, idx, "mlp")
        with timer.stage("ffn_input"):
            p = M.linear(h, w["ffn.in.weight"], loras=w.lora("ffn.in"))
        del h
        with timer.stage("swiglu"):
            y = self.swiglu(p)
        del p
        with timer.stage("ffn_output"):
            y = M.linear(y, w["ffn.out.weight"], loras=w.lora("ffn.out"))
            self.gated_residual(x, y, table, idx, "mlp", inplace=True)
        return x
