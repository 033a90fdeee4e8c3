"""GPU fast path: the block's operations (`model.BlockOps`) with the elementwise work in fused Triton kernels.

Same operations, same order, same BF16 roundings as the reference — each kernel reproduces the rounding of the torch
ops it replaces (see `kernels/`) — so a trajectory through this path equals the reference path bit for bit on the
same GPU. What changes is traffic: the AdaLN rows are read from the table by row index inside the kernels instead of
six gathered (S, H) tensors per block, modulation and gated residuals are one pass each (the residual update in
place), rotary writes the attention layout directly, and SwiGLU reads the fused FFN input once. The tables' layout
stays the model's (`model.MODULATION_BLOCKS`): these ops pass each sublayer's block positions to the kernels.

The 5376-wide RMSNorm is `F.rms_norm` unless `FUSED_NORM_MODULATE` (a kernel summing squares in the order of torch's
vectorized CUDA kernel, enabled only where the GPU test shows it reproduces those bits).
The per-head QK norm (128 channels) is fused with rotary: its kernel sums squares in the order of torch's vectorized
CUDA RMSNorm, and the GPU test shows it reproduces `F.rms_norm` (`FUSED_QK_NORM`).
"""

from __future__ import annotations

import torch

from .._imports import vflash_kernels
from . import model as M
from .config import H3Config

__all__ = ["FUSED_NORM_MODULATE", "FusedOps"]

# Whether the fused QK RMSNorm + rotary kernel replaces F.rms_norm + rotary. Measured on an H200 (torch 2.11, triton
# 3.6, 2026-11-30): 0 differing elements against F.rms_norm + rotary at S = 19,796, 38,222 and 100,000, full width
# (tests/test_kernels.py, GPU); 0.42 / 0.81 ms instead of 5.9 / 11.3 ms per block. Re-check after a torch upgrade.
FUSED_QK_NORM = True
# Whether the 5376-wide RMSNorm and the AdaLN modulation run as one kernel (`rms_norm_modulate`, torch's reduction
# order for its vectorized CUDA RMSNorm) instead of `F.rms_norm` + `modulate`. Measured on an H200 (torch 2.11,
# triton 3.6, 2026-11-30): 0 of 106,423,296 / 205,481,472 elements differ at S = 19,796 / 38,222 for both halves
# (tests/test_rms_norm_modulate.py, GPU); 0.177 / 0.345 ms instead of 0.244 / 0.462 ms. Re-check after a torch upgrade.
FUSED_NORM_MODULATE = True


class FusedOps(M.BlockOps):
    """`BlockOps` with the elementwise work in Triton kernels (same operations, same roundings); the residual stream
    is updated in place by the gated residuals."""

    def __init__(self, config: H3Config, attention: M.AttentionFn, reduce=None):
        super().__init__(config, attention, reduce)
        vflash_kernels()
        from vflash_kernels.gated_residual import gated_residual
        from vflash_kernels.modulate import modulate
        from vflash_kernels.rms_norm_modulate import rms_norm_modulate
        from vflash_kernels.rope import qk_norm_rope, rope
        from vflash_kernels.swiglu import swiglu

        self._modulate, self._gated_residual, self._rope = modulate, gated_residual, rope
        self._qk_norm_rope, self._swiglu, self._rms_norm_modulate = qk_norm_rope, swiglu, rms_norm_modulate

    def norm_modulate(
        self, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str
    ) -> torch.Tensor:
        """RMSNorm then AdaLN modulation of the (1, S, H) stream: one kernel or two (`FUSED_NORM_MODULATE`)."""
        blocks = M.MODULATION_BLOCKS[which]
        if FUSED_NORM_MODULATE:
            return self._rms_norm_modulate(
                x, weight, self.config.norm_eps, table, row_index,
                shift_block=blocks.shift, scale_block=blocks.scale, table_blocks=blocks.count,
            )
        return self._modulate(
            M.rms_norm(x, weight, self.config.norm_eps), table, row_index,
            shift_block=blocks.shift, scale_block=blocks.scale, table_blocks=blocks.count,
        )

    def qk_norm_rope(
        self, qkv: torch.Tensor, norm_q: torch.Tensor, norm_k: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        if rotary is None:  # the text refiner: no rotary, and it runs once per request
            return super().qk_norm_rope(qkv, norm_q, norm_k, rotary)
        if FUSED_QK_NORM:
            return self._qk_norm_rope(qkv, norm_q, norm_k, cfg.qk_norm_eps, *rotary, head_dim=cfg.attention_head_dim)
        q, k, v = (part.unflatten(-1, (cfg.num_attention_heads, -1)) for part in qkv.split(cfg.inner_dim, dim=-1))
        q, k = self._rope(M.rms_norm(q, norm_q, cfg.qk_norm_eps), M.rms_norm(k, norm_k, cfg.qk_norm_eps), *rotary)
        return q, k, v

    def swiglu(self, p: torch.Tensor) -> torch.Tensor:
        return self._swiglu(p)

    def gated_residual(
        self, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str
    ) -> torch.Tensor:
        blocks = M.MODULATION_BLOCKS[which]
        if blocks.gate is None:
            raise ValueError(f"the {which!r} modulation table has no gate")
        return self._gated_residual(
            x, y, table, row_index, gate_block=blocks.gate, table_blocks=blocks.count, inplace=True
        )
