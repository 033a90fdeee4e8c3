"""What the kernel parity tests share beyond the model's torch reference: the AdaLN table layout as the engine passes
it to the kernels (`vflash_core.engine.fused`)."""

from __future__ import annotations

from vflash_core.engine.model import MODULATION_BLOCKS


def shift_scale_blocks(which: str) -> dict[str, int]:
    """The `shift_block`, `scale_block`, `table_blocks` arguments of the modulating kernels for `which`'s table."""
    blocks = MODULATION_BLOCKS[which]
    return {"shift_block": blocks.shift, "scale_block": blocks.scale, "table_blocks": blocks.count}


def gate_blocks(which: str) -> dict[str, int]:
    """The `gate_block`, `table_blocks` arguments of `gated_residual` for `which`'s table (a main block's sublayer)."""
    blocks = MODULATION_BLOCKS[which]
    assert blocks.gate is not None, which
    return {"gate_block": blocks.gate, "table_blocks": blocks.count}
