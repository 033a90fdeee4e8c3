"""Transformer configuration of MiniMax-H3 and the small configurations the tests and the demo use.

Field names and defaults follow the diffusers `MiniMaxH3Transformer3DModel` config (the released `transformer/` and
`transformer_ref/` partitions), so a diffusers `config.json` loads with `H3Config.from_dict`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import VflashError, is_real
from ..fileio import check_input_file
from ..formats import is_positive

__all__ = [
    "AUDIO_TAG", "FP32_PARTS", "NUM_MODALITIES", "PRESETS", "TEXT_ENCODER_LAYER", "TEXT_TAG", "VIDEO_TAG", "H3Config",
    "aux_shapes", "block_shapes",
]

# Modality tags of the packed sequence; one AdaLN table row exists per (timestep, tag).
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2
NUM_MODALITIES = 3
# H3 conditions on the text encoder's hidden_states[50]: the residual stream after Qwen3-VL's decoder layer 49.
TEXT_ENCODER_LAYER = 50
# The parts the released checkpoint stores in fp32 and diffusers keeps in fp32 when it loads the model in bf16
# (`_keep_in_fp32_modules`, whose non-persistent rope buffer has no weight): the patch projections, the time embedder
# and the output heads, as prefixes of their tensors' names. Everything else is bf16.
FP32_PARTS = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")


@dataclass(frozen=True)
class H3Config:
    """Shape of one MiniMax-H3 transformer. Defaults are the released 33 B checkpoint."""

    num_attention_heads: int = 56  # heads of every attention (main blocks and token refiner)
    attention_head_dim: int = 128  # channels per head; heads * head_dim = 7168 != hidden_size
    hidden_size: int = 5376  # width of the residual stream
    num_layers: int = 50  # main blocks
    num_refiner_layers: int = 2  # token-refiner blocks over the text stream
    ffn_dim: int = 14336  # SwiGLU inner width
    in_channels: int = 24  # video latent channels
    audio_in_channels: int = 32  # audio latent channels (one row = one latent of one stereo channel)
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) video patch
    text_dim: int = 5120  # text-encoder hidden size
    freq_dim: int = 256  # sinusoidal timestep embedding width
    time_embed_hidden_dim: int = 5376  # timestep MLP inner width
    time_embed_dim: int = 2688  # timestep MLP output width = AdaLN projection input
    rope_freq_dim: int = 16  # rotary frequencies per (t, h, w) axis
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    inner_dim: int = field(init=False)  # num_attention_heads * attention_head_dim
    rotary_dim: int = field(init=False)  # 2 * 3 * rope_freq_dim leading channels of each head are rotated
    video_patch_dim: int = field(init=False)  # in_channels * prod(patch_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "inner_dim", self.num_attention_heads * self.attention_head_dim)
        object.__setattr__(self, "rotary_dim", 6 * self.rope_freq_dim)
        pt, ph, pw = self.patch_size
        object.__setattr__(self, "video_patch_dim", self.in_channels * pt * ph * pw)
        if self.rotary_dim > self.attention_head_dim:
            raise ValueError(
                f"rope_freq_dim={self.rope_freq_dim} rotates {self.rotary_dim} channels, more than the "
                f"attention_head_dim={self.attention_head_dim}."
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any], what: str = "transformer config") -> H3Config:
        """Build from a diffusers `config.json` dict; keys starting with `_` and unknown keys are ignored. A value of
        the wrong type (a hand-edited or corrupt config) raises `VflashError` naming the key."""
        if not isinstance(values, dict):
            raise VflashError(f"{what} must be a JSON object, got {type(values).__name__}")
        fields = {f.name: f.type for f in dataclasses.fields(cls) if f.init}
        chosen = {k: v for k, v in values.items() if k in fields}
        for key, value in chosen.items():
            if key == "patch_size":
                expected = "three positive integers"
                valid = isinstance(value, (list, tuple)) and len(value) == 3 and all(is_positive(p) for p in value)
            elif fields[key] == "float":
                expected = "a positive number"
                valid = is_real(value) and value > 0
            else:
                expected, valid = "a positive integer", is_positive(value)
            if not valid:
                raise VflashError(f"{what}: {key} must be {expected}, got {value!r}")
        return cls(**chosen)

    @classmethod
    def from_file(cls, path: str | Path) -> H3Config:
        check_input_file(path, "transformer config")  # a FIFO would block the read
        try:
            values = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise VflashError(f"{path} cannot be read as a JSON transformer config: {exc}") from None
        return cls.from_dict(values, str(path))

    def to_dict(self) -> dict[str, Any]:
        """The init fields only, JSON-ready (the diffusers config keys)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["patch_size"] = list(self.patch_size)
        return out

    @classmethod
    def preset(cls, name: str) -> H3Config:
        """A named configuration; an unknown name raises and lists the known ones."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown H3 config preset {name!r}; known: {sorted(PRESETS)}") from None


PRESETS: dict[str, dict[str, Any]] = {
    # The released checkpoint.
    "h3": {},
    # The diffusers unit-test transformer, widened to the released latent channels so the offline diffusers
    # pipeline blocks (which fall back to 24 video / 32 audio channels without VAEs) can drive it. Keeps the real
    # quirks: inner (32) != hidden (24), partial rotary (12 of 16 channels).
    "tiny": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=24,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=32,
        text_dim=8,
        freq_dim=8,
        time_embed_hidden_dim=24,
        time_embed_dim=16,
        rope_freq_dim=2,
    ),
    # The embedded demo's transformer (`family.DEMO_FAMILY`): channels match its 8-channel video and audio VAEs and
    # its 32-wide Qwen3-VL; keeps inner (64) != hidden (48) and partial rotary (24 of 32 channels), as released.
    "demo": dict(
        num_attention_heads=2,
        attention_head_dim=32,
        hidden_size=48,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=96,
        in_channels=8,
        audio_in_channels=8,
        text_dim=32,
        freq_dim=16,
        time_embed_hidden_dim=48,
        time_embed_dim=32,
        rope_freq_dim=4,
    ),
}


def block_shapes(config: H3Config, prefix: str, with_adaln: bool) -> dict[str, tuple[int, ...]]:
    """Internal names and shapes of one main block (`blocks.{i}`) or refiner block (`refiner.{j}`)."""
    h, inner, d, f = config.hidden_size, config.inner_dim, config.attention_head_dim, config.ffn_dim
    shapes = {
        f"{prefix}.norm1.weight": (h,),
        f"{prefix}.attn.qkv.weight": (3 * inner, h),
        f"{prefix}.attn.norm_q.weight": (d,),
        f"{prefix}.attn.norm_k.weight": (d,),
        f"{prefix}.attn.out.weight": (h, inner),
        f"{prefix}.norm2.weight": (h,),
        f"{prefix}.ffn.in.weight": (2 * f, h),
        f"{prefix}.ffn.out.weight": (h, f),
    }
    if with_adaln:
        shapes[f"{prefix}.adaln.weight"] = (18 * h, config.time_embed_dim)
        shapes[f"{prefix}.adaln.bias"] = (18 * h,)
    return shapes


def aux_shapes(config: H3Config) -> dict[str, tuple[int, ...]]:
    """Internal names and shapes of every tensor outside the main blocks and refiner blocks."""
    h, t = config.hidden_size, config.time_embed_dim
    linear = {
        "proj_in": (h, config.video_patch_dim),
        "audio_proj_in": (h, config.audio_in_channels),
        "context_embedder": (h, config.text_dim),
        "time_embedder.linear_1": (config.time_embed_hidden_dim, config.freq_dim),
        "time_embedder.linear_2": (t, config.time_embed_hidden_dim),
        "norm_out.linear": (2 * h, t),
        "proj_out": (config.video_patch_dim, h),
        "audio_proj_out": (config.audio_in_channels, h),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (out_f, in_f) in linear.items():
        shapes[f"{name}.weight"] = (out_f, in_f)
        shapes[f"{name}.bias"] = (out_f,)
    shapes["norm_out.norm.weight"] = (h,)
    shapes["refiner.final_norm.weight"] = (h,)
    return shapes
