"""A random-weight taeh3 file (the tiny MiniMax-H3 video decoder core's `taesd` preview method loads) in core's layout.

`python taeh3.py DEST` (ComfyUI's Python, cwd = the ComfyUI root) writes `DEST/vae_approx/taeh3_small.safetensors`:
the state dict of core's own `comfy.taesd.taehv.TAEHV` built as core's `VAE` builds it for a taeh3 file (24 latent
channels, 12 output channels of the last decoder conv: RGB at patch size 2), seeded. Core's loader infers only those
two counts from the file; the widths are the class's own (64 in the encoder, 256-128-64-64 in the decoder), so the
file has the released architecture: 11.3 M parameters, 22.7 MB in FP16.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

NAME = "taeh3_small.safetensors"


def state_dict(seed: int = 3) -> dict[str, torch.Tensor]:
    """Core's module leaves its convolutions uninitialised (`comfy.ops.disable_weight_init`): each weight gets a
    normal with standard deviation 1/sqrt(fan_in), so activations stay O(1) through the decoder (its output, clamped
    to 0..1, is not constant), and each bias one with standard deviation 0.05."""
    from comfy.taesd.taehv import TAEHV

    model = TAEHV(latent_channels=24, latent_format=None)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.ndim == 4:
            std = 1.0 / math.sqrt(tensor[0].numel())
        else:
            std = 0.05
        out[name] = (torch.randn(tensor.shape, generator=g) * std).half()
    return out


def write_file(dest: Path) -> Path:
    from safetensors.torch import save_file

    sys.path.insert(0, ".")
    from comfy.cli_args import args

    args.cpu = True
    (dest / "vae_approx").mkdir(parents=True, exist_ok=True)
    path = dest / "vae_approx" / NAME
    save_file(state_dict(), str(path))
    return path


if __name__ == "__main__":
    print(write_file(Path(sys.argv[1])))
