"""LoRA adapters for H3 as separate low-rank residuals on internal linear names.

Base matrices are never modified: each adapted linear adds `scale * B(A(x))` to its output rows, with
`scale = strength * alpha / rank` per module. Accepted files (those diffusers' H3 LoRA loader accepts):

* diffusers / peft: `transformer.<module>.lora_A.weight` / `lora_B.weight` (or `transformer_ref.`), or an unprefixed
  peft dump with the `.default.` infix, over diffusers module names;
* original names (LightX2V, ai-toolkit, kohya, musubi): optional `diffusion_model.` or flattened `lora_unet_` prefix,
  `lora_down`/`lora_up` (+ per-module `.alpha`) or `lora_A`/`lora_B`, over `blocks.{i}.attn.qkv_proj`, `mlp.fc1`, ...;
* DiffSynth: original names with peft's `.default.` infix, trained on the raw per-head-interleaved QKV.

Scale semantics follow diffusers: per-module `.alpha` tensors are folded into the factors (power-of-two split between
down and up, multiplied in the factors' dtype), after which alpha == rank; otherwise a numeric `alpha` in the file's
`__metadata__` is a uniform network alpha (`alpha / rank` of each module); otherwise alpha == rank. Unknown keys are
an error that lists them.

Targets: `blocks.{i}.attn.qkv` (three row ranges q, k, v), `attn.out`, `ffn.in` ([value; gate] rows), `ffn.out`,
`adaln`; the same under `refiner.{j}` (no adaln); and `proj_in`, `audio_proj_in`, `context_embedder`,
`time_embedder.linear_{1,2}`, `norm_out.linear`, `proj_out`, `audio_proj_out`. Those feeding only the AdaLN tables
(`adaln`, `time_embedder.*`, `norm_out.linear`) are folded into the compiled tables by the compiler.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.config import H3Config, aux_shapes
from ..engine.model import LoraResidual
from ..errors import WeightFileError
from ..formats import is_number
from ..tensor_store import TensorStore
from .checkpoint import AUX_NAMES, BLOCK_NAMES

__all__ = ["TABLE_ONLY", "Adapter", "load_adapter"]

# Internal linear names whose LoRA only affects the timestep tables.
TABLE_ONLY = re.compile(r"^(blocks\.\d+\.adaln|time_embedder\.linear_[12]|norm_out\.linear)$")


def _block_linears(column: int) -> dict[str, tuple[str, int | None]]:
    """A block's LoRA-adaptable linears in one layout (`BLOCK_NAMES` column: 0 diffusers, 1 original) -> (internal
    linear, for diffusers' to_q / to_k / to_v its third of the fused QKV, else None)."""
    linears: dict[str, tuple[str, int | None]] = {}
    for linear in ("attn.qkv", "attn.out", "ffn.in", "ffn.out", "adaln"):
        module = BLOCK_NAMES[f"{linear}.weight"][column].removesuffix(".weight")
        thirds = enumerate("qkv") if "{}" in module else [(None, "")]
        linears.update({module.format(p): (linear, k) for k, p in thirds})
    return linears


_DIFFUSERS_BLOCK, _ORIGINAL_BLOCK = _block_linears(0), _block_linears(1)
_DIFFUSERS_AUX = {diffusers: internal for internal, (diffusers, _) in AUX_NAMES.items()}
_ORIGINAL_AUX = {original: internal for internal, (_, original) in AUX_NAMES.items()}
# Module names of the main and refiner blocks: (block list, index, module in the block).
_DIFFUSERS_BLOCKS = r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)"
_ORIGINAL_BLOCKS = r"(blocks|token_refiner\.blocks)\.(\d+)\.(.+)"
_MUSUBI_MODULES = [
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
]


@dataclass
class Adapter:
    """A parsed LoRA file: residuals per internal linear name, and how its scale was determined."""

    path: Path
    format: str  # "diffusers", "original", "diffsynth"
    alpha_source: str  # "tensor" (folded), "metadata", "none"
    network_alpha: float | None
    strength: float
    residuals: dict[str, list[LoraResidual]] = field(default_factory=dict)

    @property
    def ranks(self) -> dict[str, int]:
        return {name: int(r.down.shape[0]) for name, rs in self.residuals.items() for r in rs[:1]}

    def for_prefix(self, prefix: str) -> dict[str, tuple[LoraResidual, ...]]:
        """Residuals of one block (`blocks.3`) keyed by the local linear name (`attn.qkv`)."""
        start = prefix + "."
        return {name[len(start) :]: tuple(rs) for name, rs in self.residuals.items() if name.startswith(start)}

    def aux(self) -> dict[str, tuple[LoraResidual, ...]]:
        return {name: tuple(rs) for name, rs in self.residuals.items() if not name.startswith(("blocks.", "refiner."))}


def load_adapter(path: str | Path, config: H3Config, strength: float = 1.0) -> Adapter:
    """Parse a LoRA safetensors file onto the internal linear names of a model with `config`."""
    if not is_number(strength):
        raise WeightFileError(f"{path}: LoRA strength must be a finite number, got {strength!r}")
    store = TensorStore(path)
    state = store.read(store.names)
    _check_values(state, Path(path))
    has_alpha_tensors = any(k.endswith(".alpha") for k in state)
    network_alpha = None
    if not has_alpha_tensors and "alpha" in store.metadata:
        try:
            network_alpha = float(store.metadata["alpha"])
        except ValueError:
            raise WeightFileError(f"{path}: `__metadata__` alpha {store.metadata['alpha']!r} is not a number") from None
        if not math.isfinite(network_alpha) or network_alpha <= 0:
            raise WeightFileError(
                f"{path}: `__metadata__` alpha must be a positive finite number, got {store.metadata['alpha']!r}"
            )
    alpha_source = "tensor" if has_alpha_tensors else ("metadata" if network_alpha is not None else "none")

    original = any(
        k.startswith(("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.", "lora_unet_"))
        for k in state
    )
    if original:
        fmt, pairs = _original_pairs(state, Path(path))
    else:
        fmt, pairs = "diffusers", _diffusers_pairs(state, Path(path))

    adapter = Adapter(Path(path), fmt, alpha_source, network_alpha, strength)
    inner, ffn = config.inner_dim, config.ffn_dim
    for (target, part), (down, up) in pairs.items():
        rank = down.shape[0]
        alpha = network_alpha if network_alpha is not None else float(rank)
        scale = strength * alpha / rank
        if target.endswith("attn.qkv") and part is None:  # fused qkv_proj: shared A, B split in thirds
            if fmt == "diffsynth":
                d = config.attention_head_dim
                up = up.reshape(config.num_attention_heads, 3, d, -1).transpose(0, 1).reshape(3 * inner, -1)
            for k, up_k in enumerate(up.chunk(3)):
                adapter.residuals.setdefault(target, []).append(
                    LoraResidual(down.clone(), up_k.contiguous(), scale, k * inner)
                )
        elif target.endswith("attn.qkv"):
            assert part is not None  # the branch above took the fused qkv_proj
            adapter.residuals.setdefault(target, []).append(LoraResidual(down, up.contiguous(), scale, part * inner))
        else:
            if target.endswith("ffn.in") and fmt != "diffusers":  # [gate; value] -> [value; gate]
                gate, value = up[:ffn], up[ffn:]
                up = torch.cat([value, gate])
            adapter.residuals.setdefault(target, []).append(LoraResidual(down, up.contiguous(), scale, 0))
    adapter.residuals = {k: sorted(v, key=lambda r: r.row_start) for k, v in sorted(adapter.residuals.items())}
    _validate_shapes(adapter, config)
    return adapter


_FACTOR = re.compile(r".*\.lora_(A|B|down|up)(\.default)?\.weight$")


def _check_values(state: dict[str, torch.Tensor], path: Path) -> None:
    """Factors are non-empty finite float matrices and each `.alpha` one positive finite number, checked before
    they are used (a 0-d factor has no rank; a NaN or infinite value would poison every output it touches; alpha
    <= 0 has no meaning and would never finish folding). Keys of neither kind are left to the unknown-key report."""
    problems = []
    for key, tensor in sorted(state.items()):
        if key.endswith(".alpha"):
            value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
            if value is None or not math.isfinite(value) or value <= 0:
                shown = f"shape {list(tensor.shape)}" if value is None else f"{value:g}"
                problems.append(f"{key} must be one positive finite number, got {shown}")
        elif _FACTOR.match(key):
            if tensor.ndim != 2 or 0 in tensor.shape:
                problems.append(f"{key} must be a non-empty matrix, got shape {list(tensor.shape)}")
            elif not tensor.is_floating_point():
                problems.append(f"{key} must hold floating-point values, got {tensor.dtype}")
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{key} holds NaN or infinite values")
    if problems:
        shown = "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        raise WeightFileError(f"{path}: LoRA file rejected: {shown}")


def _diffusers_pairs(
    state: dict[str, torch.Tensor], path: Path
) -> dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]]:
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        name = key.replace(".default.", ".")
        name = re.sub(r"^(transformer|transformer_ref)\.", "", name)
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        target = _target(match.group(1), _DIFFUSERS_AUX, _DIFFUSERS_BLOCKS, _DIFFUSERS_BLOCK) if match else None
        if target is None:
            unknown.append(key)
            continue
        assert match is not None  # a target comes from a match
        pairs.setdefault(target, {})[match.group(2)] = tensor
    _raise_unknown(unknown, path)
    return _complete(pairs, path)


def _target(
    module: str, aux: dict[str, str], blocks: str, block_modules: dict[str, tuple[str, int | None]]
) -> tuple[str, int | None] | None:
    """The internal linear a LoRA module adapts and, for one of diffusers' to_q / to_k / to_v, its third of the fused
    QKV; None for a module that names none."""
    if module in aux:
        return aux[module], None
    match = re.fullmatch(blocks, module)
    if not match or match.group(3) not in block_modules:
        return None
    local, part = block_modules[match.group(3)]
    prefix = "refiner" if match.group(1).startswith("token_refiner") else "blocks"
    if prefix == "refiner" and local == "adaln":
        return None
    return f"{prefix}.{match.group(2)}.{local}", part


def _original_pairs(
    state: dict[str, torch.Tensor], path: Path
) -> tuple[str, dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]]]:
    state = {k.removeprefix("diffusion_model."): v for k, v in state.items()}
    fmt = "original"
    if any(".lora_A.default." in k or ".lora_B.default." in k for k in state):
        fmt = "diffsynth"
        state = {k.replace(".default.", "."): v for k, v in state.items()}
    if any(k.startswith("lora_unet_") for k in state):
        unflat = {}
        for key, value in state.items():
            module, _, suffix = key.removeprefix("lora_unet_").partition(".")
            dotted = next((re.sub(p, r, module) for p, r in _MUSUBI_MODULES if re.fullmatch(p, module)), None)
            if dotted is None:
                _raise_unknown([key], path)
            unflat[f"{dotted}.{suffix}"] = value
        state = unflat
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        match = re.fullmatch(r"(.+)\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|alpha)", key)
        if not match:
            unknown.append(key)
            continue
        part = {
            "lora_down.weight": "A", "lora_A.weight": "A", "lora_up.weight": "B", "lora_B.weight": "B", "alpha": "alpha"
        }[match.group(2)]
        groups.setdefault(match.group(1), {})[part] = tensor
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    for module, parts in groups.items():
        target = _target(module, _ORIGINAL_AUX, _ORIGINAL_BLOCKS, _ORIGINAL_BLOCK)
        if target is None:
            unknown.extend(f"{module}.{p}" for p in parts)
            continue
        down, up = parts.get("A"), parts.get("B")
        if "alpha" in parts and down is not None and up is not None:
            # Fold alpha / rank into the factors as diffusers does: powers of two moved from down to up.
            scale_down, scale_up = parts["alpha"].item() / down.shape[0], 1.0
            while scale_down * 2 < scale_up:
                scale_down *= 2
                scale_up /= 2
            down, up = down * scale_down, up * scale_up
        pairs[target] = {k: v for k, v in (("A", down), ("B", up)) if v is not None}
    _raise_unknown(unknown, path)
    return fmt, _complete(pairs, path)


def _complete(pairs: dict, path: Path) -> dict:
    incomplete = sorted(
        str(t[0]) + ("" if t[1] is None else f"[{t[1]}]") for t, p in pairs.items() if set(p) != {"A", "B"}
    )
    if incomplete:
        raise WeightFileError(f"{path}: LoRA modules without both down and up factors: {', '.join(incomplete)}")
    return {t: (p["A"], p["B"]) for t, p in pairs.items()}


def _raise_unknown(keys: list[str], path: Path) -> None:
    if keys:
        shown = ", ".join(sorted(keys)[:12]) + (f" (+{len(keys) - 12} more)" if len(keys) > 12 else "")
        raise WeightFileError(f"{path}: {len(keys)} LoRA key(s) do not name an H3 module: {shown}")


def _validate_shapes(adapter: Adapter, config: H3Config) -> None:
    """Each residual's factors must fit the linear it adapts."""
    h, inner, f, t = config.hidden_size, config.inner_dim, config.ffn_dim, config.time_embed_dim
    # (fan_in, fan_out) of each linear; the fused QKV's residuals each cover `inner` of its rows
    io = {"attn.qkv": (h, inner), "attn.out": (inner, h), "ffn.in": (h, 2 * f), "ffn.out": (f, h), "adaln": (t, 18 * h)}
    aux_linears = {name.removesuffix(".weight"): shape for name, shape in aux_shapes(config).items() if len(shape) == 2}
    io.update({name: (fan_in, fan_out) for name, (fan_out, fan_in) in aux_linears.items()})
    problems = []
    for name, residuals in adapter.residuals.items():
        match = re.fullmatch(r"(?:blocks|refiner)\.(\d+)\.(.+)", name)
        local = match.group(2) if match else name
        if match and int(match.group(1)) >= (
            config.num_layers if name.startswith("blocks") else config.num_refiner_layers
        ):
            problems.append(f"{name}: no such block")
            continue
        fan_in, fan_out = io[local]
        for r in residuals:
            if (
                r.down.ndim != 2 or r.up.ndim != 2
                or r.down.shape[1] != fan_in or r.up.shape != (fan_out, r.down.shape[0])
            ):
                problems.append(
                    f"{name}: factors {list(r.down.shape)} / {list(r.up.shape)} do not fit [{fan_out}, {fan_in}]"
                )
    if problems:
        raise WeightFileError(f"{adapter.path}: LoRA does not fit this model: " + "; ".join(problems[:8]))
