"""What the weights compiler writes and the runtime reads: file format tags and the hardware identity of a compile.

Both sides import these from here, so loading a compiled model never imports the compiler.
"""

from __future__ import annotations

import torch

from .errors import VflashError

WEIGHTS_RECEIPT_FORMAT = "vflash-receipt/1"  # `compiler prepare`: a profile bound to hashed base weights and adapter
ARTIFACT_FORMAT = "vflash-artifact/1"  # `compiler compile`: packed blocks and auxiliary tensors
# `compiler compile` for an FP8 profile (approximate): the same, with the four block linears as E4M3 codes + FP32 row
# scales (`fp8.quantize_block`); a kind of its own, so no BF16 loader or profile ever takes one for the other.
ARTIFACT_FP8_FORMAT = "vflash-artifact-fp8-rows/1"
OVERLAY_FORMAT = "vflash-schedule-overlay/1"  # `compiler compile`: the fixed-schedule AdaLN tables
PIPELINE_FORMAT = "vflash-pipeline/1"  # `prepare-pipeline`: a profile bound to its six assets


def device_arch(device: torch.device | str) -> str:
    """`"cpu"` or `"smXY"` from the CUDA compute capability: where a compile's tables were computed."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    raise VflashError(f"unsupported device {device}")
