"""Test-only H3 transformer files in the forms users bring (original-layout single files, pruned files, GGUF files),
written from random weights in internal names (`vflash_core.weights.synthetic`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from vflash_core.engine.config import H3Config
from vflash_core.engine.model import rope_inv_freq, time_embedding
from vflash_core.weights.gguf_file import DEQUANTIZERS, require_gguf
from vflash_core.weights.synthetic import to_original_names


def write_original_transformer(
    path: str | Path,
    config: H3Config,
    weights: dict[str, torch.Tensor],
    qkv_layout: str = "stacked",
    embed_config: bool = True,
) -> Path:
    """A single original-layout file (as published single files are); optionally records the config in metadata."""
    path = Path(path)
    metadata = {"config": json.dumps(config.to_dict())} if embed_config else {}
    save_file(to_original_names(weights, config, qkv_layout), str(path), metadata=metadata)
    return path


def prune_adaln(
    weights: Mapping[str, torch.Tensor], config: H3Config, grid: int = 1025, rank: int = 8
) -> dict[str, torch.Tensor]:
    """`weights` as a pruned file holds them: the post-SiLU time-embedding curve sampled at `grid` evenly spaced t in
    [0, 1] (fp32), projected on its top `rank` right-singular directions U: `adaln_t_table` = curve @ U [grid, rank],
    each AdaLN projection (blocks and `norm_out.linear`) W -> W @ U in fp32 with its bias in fp32, no time embedder.
    The pruned model approximates the full one as closely as rank `rank` and the interpolation allow."""
    t = torch.linspace(0.0, 1.0, grid, dtype=torch.float64).float()
    curve = torch.nn.functional.silu(time_embedding(t, weights, config))
    basis = torch.linalg.svd(curve, full_matrices=False).Vh[:rank].T.contiguous()  # (time_embed_dim, rank)
    out = {name: tensor for name, tensor in weights.items() if not name.startswith("time_embedder.")}
    out["adaln_t_table"] = (curve @ basis).contiguous()
    for name in [n for n in out if n.endswith(".adaln.weight") or n == "norm_out.linear.weight"]:
        out[name] = (out[name].float() @ basis).contiguous()
        bias = name.removesuffix("weight") + "bias"
        out[bias] = out[bias].float()
    return out


#: Divisors sizing each k-quant's fp16 super-block scales so that random codes give values of about the target
#: magnitude: the largest |sub-scale x code| the type's codes reach.
_K_QUANT_RANGE = {"Q2_K": 15 * 3, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32}


# Byte offsets of the fp16 scale fields in one block of each k-quant.
_K_QUANT_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def write_gguf_transformer(
    path: str | Path,
    config: H3Config,
    weights: Mapping[str, torch.Tensor],
    quant_type: Callable[[str, tuple[int, ...]], str],
    seed: int = 0,
) -> Path:
    """A GGUF of a Comfy-Org file (`write_comfy_transformer`'s tensors, original names) as ComfyUI-GGUF's converter and
    llama.cpp's quantizer lay it out: `quant_type(name, torch shape)` gives each tensor's ggml type. F32 / F16 / BF16
    and the legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) hold `weights` quantized by the gguf package; the gguf
    package has no k-quant quantizer, so a k-quant tensor (Q2_K ... Q6_K) holds random codes and sub-scales from
    `seed`, with fp16 super-block scales giving values of about the weight's fan_in^-1/2."""
    import numpy as np

    gguf = require_gguf()

    path = Path(path)
    state = {**to_original_names(dict(weights), config), "rope.inv_freq": rope_inv_freq(config)}
    writer = gguf.GGUFWriter(str(path), arch="minimax_h3")
    rng = np.random.default_rng(seed)
    for name, tensor in state.items():
        qtype = quant_type(name, tuple(tensor.shape))
        ggml = gguf.GGMLQuantizationType[qtype]
        values = tensor.float().numpy()
        if qtype in _K_QUANT_RANGE:
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml]
            blocks = rng.integers(0, 256, size=(values.size // block_size, type_size), dtype=np.uint8)
            scale = values.shape[-1] ** -0.5 / _K_QUANT_RANGE[qtype]
            for at in _K_QUANT_HALVES[qtype]:
                halves = (rng.uniform(0.5, 1.0, size=blocks.shape[0]) * scale).astype(np.float16)
                blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
            data = blocks.reshape(*values.shape[:-1], -1)
        elif qtype == "F32":
            data = values
        else:
            data = gguf.quants.quantize(values, ggml)
        writer.add_tensor(name, data, raw_dtype=ggml if qtype != "F32" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Byte offsets of the fp16 fields of one block of each quantized type (random bytes there could be NaN or huge).
GGUF_HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_gguf_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of `qtype`, with finite fp16 scales of about 1e-2."""
    block_size, type_size, _ = DEQUANTIZERS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for at in GGUF_HALF_OFFSETS[qtype]:
        blocks[:, at : at + 2] = (rng.standard_normal(blocks.shape[0]) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
