"""Random-weight H3 transformers written in the official on-disk layouts.

No weights can be downloaded where the tests and the embedded demo run, so both build small random models here, in
exactly the layouts `checkpoint.SourceWeights` reads: the diffusers `transformer/` folder (single file or sharded with
an index), the original single-file names (stacked or per-head interleaved QKV, `mlp.fc1` as [gate; value]) and
Comfy-Org's repacked single files (with `rope.inv_freq`; optionally ComfyUI scaled-FP8, optionally pruned).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engine.config import FP32_PARTS, H3Config
from ..engine.model import rope_inv_freq
from .checkpoint import internal_shapes, source_name

__all__ = [
    "RandomWeights", "diffusers_names", "quantize_int8_convrot", "random_internal_weights", "random_like",
    "to_original_names", "write_comfy_fp8_scaled_streamed", "write_comfy_transformer", "write_delta_as_peft",
    "write_diffusers_transformer", "write_fp8_scaled_streamed", "write_random_delta", "write_random_lora",
    "write_shards",
]



def _tensor_seed(seed: int, name: str) -> int:
    """A generator seed per tensor, so any subset of a checkpoint can be drawn in any order with the same values."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


class RandomWeights(Mapping[str, torch.Tensor]):
    """A random checkpoint in internal names whose tensors are drawn on demand (on `device`) from per-tensor seeds.

    `dtype=bfloat16` gives the released mixed-precision layout (fp32 patch projections, time embedder and heads).
    Norm weights are random around 1, so a missing weight multiply cannot hide behind ones; matrices are scaled by
    fan_in^-1/2 so activations stay O(1) through every block. The same (config, seed, dtype, device type) always gives
    the same values, which lets a benchmark rebuild a model in memory that equals one written to disk earlier.
    """

    def __init__(
        self, config: H3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ):
        self.config, self.seed, self.dtype, self.device = config, seed, dtype, torch.device(device)
        self.shapes = internal_shapes(config)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        generator = torch.Generator(self.device).manual_seed(_tensor_seed(self.seed, name))
        value = torch.randn(shape, generator=generator, device=self.device)
        if "norm" in name and name.endswith(".weight") and len(shape) == 1:
            value = value.mul_(0.25).add_(1.0)
        else:
            value = value.mul_((shape[1] if len(shape) == 2 else shape[0]) ** -0.5)
        return value.to(self.dtype_of(name)).contiguous()

    def dtype_of(self, name: str) -> torch.dtype:
        pinned = self.dtype == torch.bfloat16 and name.startswith(FP32_PARTS)
        return torch.float32 if pinned else self.dtype

    def nbytes(self, name: str) -> int:
        """Bytes of tensor `name`, without drawing it."""
        return math.prod(self.shapes[name]) * self.dtype_of(name).itemsize

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_internal_weights(
    config: H3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of `RandomWeights` materialised as CPU tensors (`device` says where the numbers are drawn)."""
    weights = RandomWeights(config, seed, dtype, device)
    return {name: weights[name].cpu() for name in weights}


def diffusers_names(name: str, config: H3Config) -> list[tuple[str, slice]]:
    """Internal name -> the diffusers `MiniMaxH3Transformer3DModel` tensors it holds, with their rows."""
    source = source_name(name, original=False)
    if name.endswith(".attn.qkv.weight"):
        inner = config.inner_dim
        return [(source.format(p), slice(k * inner, (k + 1) * inner)) for k, p in enumerate("qkv")]
    return [(source, slice(None))]


def to_original_names(
    weights: dict[str, torch.Tensor], config: H3Config, qkv_layout: str = "stacked"
) -> dict[str, torch.Tensor]:
    """Internal names -> the original reference implementation's names (inverse of the diffusers converter)."""
    heads, d = config.num_attention_heads, config.attention_head_dim
    out = {}
    for name, tensor in weights.items():
        if name.endswith(".attn.qkv.weight") and qkv_layout == "interleaved":
            tensor = tensor.reshape(3, heads, d, -1).transpose(0, 1).reshape(3 * heads * d, -1).contiguous()
        elif name.endswith(".ffn.in.weight"):
            value, gate = tensor.chunk(2)
            tensor = torch.cat([gate, value]).contiguous()
        out[source_name(name, original=True)] = tensor
    return out


def write_shards(
    folder: Path, stem: str, sizes: Mapping[str, int], produce: Callable[[list[str]], dict[str, torch.Tensor]],
    max_shard_bytes: int | None = None, write_workers: int = 1,
) -> list[Path]:
    """Write safetensors files the way `save_pretrained` lays them out: `{stem}.safetensors`, or shards
    `{stem}-0000k-of-0000n.safetensors` plus `{stem}.safetensors.index.json` when `max_shard_bytes` is given.

    `sizes` lists the source keys in order with their byte sizes; `produce(keys)` returns the CPU tensors (file
    names -> tensors) of one shard. Shards are produced one at a time, so a full-size model is never held in host
    memory whole, and up to `write_workers` of them are written concurrently while the next is produced.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    if max_shard_bytes is None:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map: dict[str, str] = {}
    total = 0
    workers = max(1, write_workers)
    with ThreadPoolExecutor(workers) as pool:
        pending: list[Future] = []
        for keys, file_name in zip(groups, names):
            while sum(not f.done() for f in pending) >= workers:  # bound the shards held in memory
                wait(pending, return_when=FIRST_COMPLETED)
            state = produce(keys)
            weight_map.update(dict.fromkeys(state, file_name))
            total += sum(t.nbytes for t in state.values())
            pending.append(pool.submit(save_file, state, str(folder / file_name), {"format": "pt"}))
            del state
        for future in pending:
            future.result()
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [folder / n for n in names]


def write_diffusers_transformer(
    folder: str | Path,
    config: H3Config,
    weights: Mapping[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    write_workers: int = 1,
) -> Path:
    """A diffusers `transformer/` folder: config.json plus one file, or shards and an index when `max_shard_bytes`.

    Tensors are taken from `weights` one shard at a time (a `RandomWeights` draws them only then); see `write_shards`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", **config.to_dict()}, indent=2) + "\n"
    )

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        state = {}
        for name in names:
            tensor = weights[name]
            for out, rows in diffusers_names(name, config):
                # Row slices of one tensor share storage, which safetensors refuses: each gets its own copy.
                state[out] = tensor[rows].to("cpu", copy=rows != slice(None))
        return state

    sizes = {n: weights.nbytes(n) if isinstance(weights, RandomWeights) else weights[n].nbytes for n in weights}
    write_shards(folder, "diffusion_pytorch_model", sizes, produce, max_shard_bytes, write_workers)
    return folder


def random_like(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One fp32 tensor of a random module state: norm-like vectors (1-D weights) around 1, biases small, matrices and
    kernels scaled by fan_in^-1/2 (activations stay O(1) through deep stacks). Drawn from a per-tensor seed."""
    generator = torch.Generator(device).manual_seed(_tensor_seed(seed, name))
    value = torch.randn(shape, generator=generator, device=device)
    if len(shape) == 1 and not name.endswith("bias"):
        return value.mul_(0.02).add_(1.0)
    if len(shape) <= 1:
        return value.mul_(0.02)
    return value.mul_(math.prod(shape[1:]) ** -0.5)


def write_random_lora(
    path: str | Path,
    config: H3Config,
    rank: int,
    alpha: float,
    seed: int = 0,
    adaln_rank: int | None = None,
    device: str | torch.device = "cpu",
) -> Path:
    """A LoRA over every main block in the original names as LightX2V publishes them (`diffusion_model.` prefix,
    `lora_A`/`lora_B`, a uniform network alpha in the metadata): fused `attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`,
    `mlp.fc2` at `rank`, and `adaln_proj.linear` at `adaln_rank` when given. The up factors are small, so the
    adapted model stays close to the base one, as a distillation LoRA does."""
    h, inner, f = config.hidden_size, config.inner_dim, config.ffn_dim
    modules = {"attn.qkv_proj": (3 * inner, h), "attn.out_proj": (h, inner), "mlp.fc1": (2 * f, h), "mlp.fc2": (h, f)}
    state = {}
    for i in range(config.num_layers):
        targets = [(m, s, rank) for m, s in modules.items()]
        if adaln_rank is not None:
            targets.append(("adaln_proj.linear", (18 * h, config.time_embed_dim), adaln_rank))
        for module, (out_f, in_f), r in targets:
            key = f"diffusion_model.blocks.{i}.{module}"
            state[f"{key}.lora_A.weight"] = (
                random_like(f"{key}.lora_A", (r, in_f), seed, device).to(torch.bfloat16).cpu()
            )
            state[f"{key}.lora_B.weight"] = (
                random_like(f"{key}.lora_B", (out_f, r), seed, device).mul_(0.1).to(torch.bfloat16).cpu()
            )
    save_file(state, str(path), metadata={"alpha": f"{alpha:g}"})
    return Path(path)


_BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def write_random_delta(path: str | Path, config: H3Config, seed: int = 0, device: str | torch.device = "cpu") -> Path:
    """A full-rank delta over every main block's four linears as FastH3 writes one: `diffusion_model.<module>.diff`
    [out, in] in the original names (small values: a fine-tune's difference)."""
    h, inner, f = config.hidden_size, config.inner_dim, config.ffn_dim
    shapes = dict(zip(_BLOCK_LINEARS, ((3 * inner, h), (h, inner), (2 * f, h), (h, f))))
    state = {}
    for i in range(config.num_layers):
        for module, shape in shapes.items():
            key = f"diffusion_model.blocks.{i}.{module}.diff"
            state[key] = random_like(key, shape, seed, device).mul_(0.01).to(torch.bfloat16).cpu()
    save_file(state, str(path))
    return Path(path)


def write_delta_as_peft(delta: str | Path, path: str | Path, config: H3Config) -> Path:
    """A block delta of `write_random_delta` as diffusers holds a full-rank delta (its converter for `diff` keys): a
    LoRA per diffusers module with A = the module's rows of the delta and B = identity, in diffusers' names (the
    fused QKV in thirds, fc1's [gate; value] as [value; gate]). What diffusers + peft load as the reference."""
    from safetensors.torch import load_file

    state = load_file(str(delta))
    out = {}
    for i in range(config.num_layers):
        block = f"diffusion_model.blocks.{i}"
        q, k, v = state[f"{block}.attn.qkv_proj.diff"].chunk(3)
        gate, value = state[f"{block}.mlp.fc1.diff"].chunk(2)
        modules = {
            "attn.to_q": q, "attn.to_k": k, "attn.to_v": v, "attn.to_out.0": state[f"{block}.attn.out_proj.diff"],
            "ff.net.0.proj": torch.cat([value, gate]), "ff.net.2": state[f"{block}.mlp.fc2.diff"],
        }
        for module, rows in modules.items():
            key = f"transformer.transformer_blocks.{i}.{module}"
            out[f"{key}.lora_A.weight"] = rows.contiguous()
            out[f"{key}.lora_B.weight"] = torch.eye(rows.shape[0], dtype=rows.dtype)
    save_file(out, str(path))
    return Path(path)


# Linears a Comfy-Org scaled-FP8 file stores as float8 (original names): block and refiner projections, condition_proj.
_FP8_LAYERS = re.compile(
    r"^((token_refiner\.)?blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2|adaln_proj\.linear)"
    r"|condition_proj)$"
)


def write_comfy_transformer(
    path: str | Path,
    config: H3Config,
    weights: Mapping[str, torch.Tensor],
    fp8: str | None = None,
    embed_config: bool = True,
    int8_convrot: int = 0,
    int8_marking: str = "comfy_quant",
) -> Path:
    """A Comfy-Org single file: original names with stacked QKV and the `rope.inv_freq` buffer, from full or pruned
    weights (an `adaln_t_table`, reduced-rank AdaLN projections). With `fp8`, the bf16 linears ComfyUI quantizes become
    float8_e4m3fn codes with one fp32 scale each (`scale = amax / 448`, `code = fp8(w / scale)`), marked the way ComfyUI
    marks them: "metadata" (`_quantization_metadata` and `<layer>.weight_scale`), "comfy_quant" (a `<layer>.comfy_quant`
    tensor each) or "legacy" (a `scaled_fp8` tensor and `<layer>.scale_weight`). With `int8_convrot` (a ConvRot group
    size, a power of 4), those linears whose columns it divides are written as ComfyUI's int8_convrot layers instead
    (`quantize_int8_convrot`), marked by `<layer>.comfy_quant` tensors or (`int8_marking="metadata"`)
    `_quantization_metadata`."""
    path = Path(path)
    state = {**to_original_names(dict(weights), config), "rope.inv_freq": rope_inv_freq(config)}
    metadata = {"config": json.dumps(config.to_dict())} if embed_config else {}
    if int8_convrot:
        int8_layers: dict[str, dict[str, object]] = {}
        for name in [
            n for n in state if n.endswith(".weight") and _FP8_LAYERS.match(n.removesuffix(".weight"))
            and state[n].shape[1] % int8_convrot == 0
        ]:
            layer = name.removesuffix(".weight")
            state[name], state[f"{layer}.weight_scale"] = quantize_int8_convrot(state[name], int8_convrot)
            int8_layers[layer] = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": int8_convrot}
            if int8_marking == "comfy_quant":
                state[f"{layer}.comfy_quant"] = torch.tensor(
                    list(json.dumps(int8_layers[layer]).encode()), dtype=torch.uint8
                )
        if int8_marking == "metadata":
            metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": int8_layers})
    if fp8 is not None:
        layers = {}
        for name in [
            n for n in state if n.endswith(".weight") and _FP8_LAYERS.match(n.removesuffix(".weight"))
            and state[n].dtype == torch.bfloat16
        ]:
            layer = name.removesuffix(".weight")
            scale = _fp8_scale(state[name])
            state[name] = (state[name].float() / scale).to(torch.float8_e4m3fn)
            conf = {"format": "float8_e4m3fn"}
            if fp8 == "legacy":
                state[f"{layer}.scale_weight"] = scale
            else:
                state[f"{layer}.weight_scale"] = scale
                if fp8 == "comfy_quant":
                    state[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
            layers[layer] = conf
        if fp8 == "metadata":
            metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
        elif fp8 == "legacy":
            state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(path), metadata=metadata)
    return path


def _fp8_scale(weight: torch.Tensor) -> torch.Tensor:
    """The one fp32 scale of a Comfy-Org scaled-FP8 linear: amax / 448."""
    return weight.float().abs().amax() / torch.finfo(torch.float8_e4m3fn).max


def write_fp8_scaled_streamed(
    path: str | Path, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], draw: Callable[[str], torch.Tensor],
    quantized: Iterable[str], metadata: Mapping[str, str] | None = None,
) -> int:
    """A Comfy-Org scaled-FP8 safetensors file written tensor by tensor: each tensor of `layout` (name -> dtype, shape)
    is drawn (`draw(name)`, on any device), the weights named in `quantized` stored as E4M3 codes with one fp32
    `.weight_scale` each (amax / 448) and listed in `_quantization_metadata` (after `metadata`), then written before
    the next is drawn, so neither host memory nor a bf16 copy of the file's size is needed. The scales are written
    first (fp32 before fp8), and each needs its whole weight, so the quantized weights are drawn twice (a first pass
    keeps only their scales). Returns the file's size in bytes."""
    from ..tensor_store import write_safetensors_streamed

    scales = {name.removesuffix("weight") + "weight_scale": _fp8_scale(draw(name)).cpu() for name in quantized}
    of_weight = {name.removesuffix("_scale"): scale for name, scale in scales.items()}
    stored = {name: (torch.float8_e4m3fn, shape) if name in of_weight else (dtype, shape)
              for name, (dtype, shape) in layout.items()}
    stored.update({name: (torch.float32, ()) for name in scales})

    def produce(name: str) -> torch.Tensor:
        if name in scales:
            return scales[name]
        tensor = draw(name)
        if name in of_weight:
            tensor = (tensor.float() / of_weight[name].to(tensor.device)).to(torch.float8_e4m3fn)
        return tensor.cpu()

    layers = {name.removesuffix(".weight"): {"format": "float8_e4m3fn"} for name in of_weight}
    marked = {**(metadata or {}), "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    size, _ = write_safetensors_streamed(path, stored, produce, marked)
    return size


def write_comfy_fp8_scaled_streamed(path: str | Path, config: H3Config, weights: RandomWeights) -> int:
    """The Comfy-Org scaled-FP8 single file `write_comfy_transformer(..., fp8="metadata")` writes from the same
    weights, written tensor by tensor (`write_fp8_scaled_streamed`): a full-size file (~34 GB) needs neither host
    memory nor a bf16 copy of its size. Returns the file's size in bytes."""
    sources = {source_name(name, original=True): name for name in weights}
    quantized = [
        out for out, name in sources.items()
        if out.endswith(".weight") and _FP8_LAYERS.match(out.removesuffix(".weight"))
        and weights.dtype_of(name) == torch.bfloat16
    ]
    inv_freq = rope_inv_freq(config)
    layout = {out: (weights.dtype_of(name), weights.shapes[name]) for out, name in sources.items()}
    layout["rope.inv_freq"] = (torch.float32, tuple(inv_freq.shape))

    def draw(out: str) -> torch.Tensor:
        if out == "rope.inv_freq":
            return inv_freq
        ((_, tensor),) = to_original_names({sources[out]: weights[sources[out]]}, config).items()
        return tensor

    return write_fp8_scaled_streamed(path, layout, draw, quantized, {"config": json.dumps(config.to_dict())})


def quantize_int8_convrot(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [rows, cols] as ComfyUI's int8_convrot quantizer writes it: rotated in fp32 by the normalised regular
    Hadamard matrix per group of `group` columns (`W @ H.T`), then int8 codes round(w / s) with one fp32 scale per
    row s = row absmax / 127; returns (codes int8 [rows, cols], scales fp32 [rows, 1])."""
    from .quantized import hadamard_signs

    rows, cols = weight.shape
    rotated = (
        weight.float().reshape(rows, cols // group, group) @ (hadamard_signs(group) / math.isqrt(group)).T
    ).reshape(rows, cols)
    scale = (rotated.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
    return (rotated / scale).round().clamp(-128, 127).to(torch.int8), scale
