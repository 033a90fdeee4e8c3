"""Random-weight H3 transformers written in the official on-disk layouts.

No weights can be downloaded where the tests and the embedded demo run, so both build small random models here, in
exactly the layouts `checkpoint.SourceWeights` reads: the diffusers `transformer/` folder (single file or sharded with
an index) and the original single-file names (stacked or per-head interleaved QKV, `mlp.fc1` as [gate; value]).
Norm weights are random too, so a missing weight multiply cannot hide behind ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import aux_shapes, block_shapes
from .config import H3Config

# Tensors the released checkpoint stores in fp32; everything else is bf16 (h3_model.md 1.2).
FP32_PREFIXES = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")


def random_internal_weights(config: H3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in internal names (CPU tensors); `dtype=bfloat16` gives the released
    mixed-precision layout. `device` only says where the random numbers are drawn (a GPU is much faster at full width).
    """
    generator = torch.Generator(device).manual_seed(seed)
    shapes = {}
    for i in range(config.num_layers):
        shapes.update(block_shapes(config, f"blocks.{i}", with_adaln=True))
    for j in range(config.num_refiner_layers):
        shapes.update(block_shapes(config, f"refiner.{j}", with_adaln=False))
    shapes.update(aux_shapes(config))
    weights = {}
    for name, shape in shapes.items():
        if "norm" in name and name.endswith(".weight") and len(shape) == 1:
            value = 1.0 + 0.25 * torch.randn(shape, generator=generator, device=device)
        else:
            fan_in = shape[1] if len(shape) == 2 else shape[0]
            value = torch.randn(shape, generator=generator, device=device) * (fan_in**-0.5)
        pinned = dtype == torch.bfloat16 and name.startswith(FP32_PREFIXES)
        weights[name] = value.to(torch.float32 if pinned else dtype).contiguous().cpu()
    return weights


def to_diffusers_names(weights: dict[str, torch.Tensor], config: H3Config) -> dict[str, torch.Tensor]:
    """Internal names -> diffusers `MiniMaxH3Transformer3DModel` state dict names."""
    out = {}
    inner = config.inner_dim
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[0] in ("blocks", "refiner") and parts[1].isdigit():
            prefix = f"transformer_blocks.{parts[1]}" if parts[0] == "blocks" else f"token_refiner.refiner_blocks.{parts[1]}"
            local = ".".join(parts[2:])
            if local == "attn.qkv.weight":
                for k, p in enumerate("qkv"):
                    out[f"{prefix}.attn.to_{p}.weight"] = tensor[k * inner : (k + 1) * inner].clone()
                continue
            local = {
                "attn.out.weight": "attn.to_out.0.weight",
                "ffn.in.weight": "ff.net.0.proj.weight",
                "ffn.out.weight": "ff.net.2.weight",
                "adaln.weight": "adaln_proj.linear.weight",
                "adaln.bias": "adaln_proj.linear.bias",
            }.get(local, local)
            out[f"{prefix}.{local}"] = tensor
        elif name == "refiner.final_norm.weight":
            out["token_refiner.final_norm.weight"] = tensor
        else:
            out[name] = tensor
    return out


def to_original_names(weights: dict[str, torch.Tensor], config: H3Config, qkv_layout: str = "stacked") -> dict[str, torch.Tensor]:
    """Internal names -> the original reference implementation's names (inverse of the diffusers converter)."""
    aux = {
        "proj_in": "video_patch_proj",
        "audio_proj_in": "audio_patch_proj",
        "context_embedder": "condition_proj",
        "time_embedder.linear_1": "time_embedder.proj_in",
        "time_embedder.linear_2": "time_embedder.proj_out",
        "norm_out.linear": "final_layer.adaln_proj.linear",
        "proj_out": "final_layer.video_out",
        "audio_proj_out": "final_layer.audio_out",
    }
    heads, d = config.num_attention_heads, config.attention_head_dim
    out = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[0] in ("blocks", "refiner") and parts[1].isdigit():
            prefix = f"blocks.{parts[1]}" if parts[0] == "blocks" else f"token_refiner.blocks.{parts[1]}"
            local = ".".join(parts[2:])
            if local == "attn.qkv.weight" and qkv_layout == "interleaved":
                tensor = tensor.reshape(3, heads, d, -1).transpose(0, 1).reshape(3 * heads * d, -1).contiguous()
            elif local == "ffn.in.weight":
                value, gate = tensor.chunk(2)
                tensor = torch.cat([gate, value]).contiguous()
            local = {
                "attn.qkv.weight": "attn.qkv_proj.weight",
                "attn.norm_q.weight": "attn.q_norm.weight",
                "attn.norm_k.weight": "attn.k_norm.weight",
                "attn.out.weight": "attn.out_proj.weight",
                "ffn.in.weight": "mlp.fc1.weight",
                "ffn.out.weight": "mlp.fc2.weight",
                "adaln.weight": "adaln_proj.linear.weight",
                "adaln.bias": "adaln_proj.linear.bias",
            }.get(local, local)
            out[f"{prefix}.{local}"] = tensor
        elif name == "refiner.final_norm.weight":
            out["token_refiner.final_norm.weight"] = tensor
        elif name == "norm_out.norm.weight":
            out["final_layer.norm.weight"] = tensor
        else:
            module, _, suffix = name.rpartition(".")
            out[f"{aux[module]}.{suffix}"] = tensor
    return out


def write_diffusers_transformer(
    folder: str | Path, config: H3Config, weights: dict[str, torch.Tensor], max_shard_bytes: int | None = None
) -> Path:
    """A diffusers `transformer/` folder: config.json plus one file, or shards and an index when `max_shard_bytes`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", **config.to_dict()}, indent=2) + "\n"
    )
    state = to_diffusers_names(weights, config)
    if max_shard_bytes is None:
        save_file(state, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        file_name = f"diffusion_pytorch_model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def write_original_transformer(
    path: str | Path, config: H3Config, weights: dict[str, torch.Tensor], qkv_layout: str = "stacked", embed_config: bool = True
) -> Path:
    """A single original-layout file (as published single files are); optionally records the config in metadata."""
    path = Path(path)
    metadata = {"config": json.dumps(config.to_dict())} if embed_config else {}
    save_file(to_original_names(weights, config, qkv_layout), str(path), metadata=metadata)
    return path
