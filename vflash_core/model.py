"""The MiniMax-H3 transformer, reference path: plain PyTorch over compiled weights and precomputed AdaLN tables.

This file is the numerical definition the fused kernels must reproduce. It follows diffusers 0.42.1
`MiniMaxH3Transformer3DModel` op for op (h3_model.md section 1.4), with three precomputations that change no bits:

* the AdaLN modulation rows and `norm_out` shift/scale come from the compiled schedule overlay (they depend on t only),
* the text stream (`context_embedder`, token refiner, final norm) is computed once per request (it depends on the
  prompt only),
* the rotary cos/sin are computed once per request (they depend on the layout only).

Every tensor keeps the batch axis of 1 the reference uses, so each torch call sees the reference's shapes. In bf16
every elementwise op rounds its own output (that rounding is part of the model); RMSNorm is `F.rms_norm`, which
multiplies by the weight in fp32 before its single rounding.

Shapes: S packed rows, H hidden, I = heads * head_dim (inner), R rotary channels per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import NUM_MODALITIES, H3Config

# (B, S, heads, head_dim) q, k, v -> (B, S, heads, head_dim)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full, unmasked attention through `F.scaled_dot_product_attention`, called exactly as diffusers' native backend."""
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), dropout_p=0.0, is_causal=False
    )
    return out.permute(0, 2, 1, 3)


@dataclass(frozen=True)
class LoraResidual:
    """One low-rank residual `scale * B(A(x))` added to a linear's output rows [row_start, row_stop).

    down: A (rank, in); up: B (rows, rank). The branch runs in the factors' dtype, as peft's unfused forward does.
    """

    down: torch.Tensor
    up: torch.Tensor
    scale: float
    row_start: int = 0

    def to(self, device: torch.device) -> LoraResidual:
        return LoraResidual(self.down.to(device), self.up.to(device), self.scale, self.row_start)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, loras: tuple[LoraResidual, ...] = ()) -> torch.Tensor:
    """`F.linear` plus separate LoRA residuals; base weights are never modified."""
    y = F.linear(x, weight, bias)
    for lora in loras:
        x_lora = x.to(lora.down.dtype)
        delta = F.linear(F.linear(x_lora, lora.down), lora.up) * lora.scale
        rows = slice(lora.row_start, lora.row_start + lora.up.shape[0])
        if rows.start == 0 and rows.stop == y.shape[-1]:
            y = (y + delta).to(y.dtype)
        else:
            y[..., rows] = (y[..., rows] + delta).to(y.dtype)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# -- rotary embedding ---------------------------------------------------------------------------------------------


def rope_inv_freq(config: H3Config) -> torch.Tensor:
    """(rope_freq_dim,) fp32 on the CPU, as the reference computes its `rope.inv_freq` buffer."""
    n = config.rope_freq_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, 3) positions -> fp32 cos, sin of shape (S, 6 * rope_freq_dim): [t | h | w] angles, duplicated."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)
    freqs_t, freqs_h, freqs_w = freqs.unbind(dim=1)
    freqs = torch.cat((freqs_t, freqs_h, freqs_w), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the leading R channels of every head of (1, S, heads, D); cos/sin (1, S, 1, R) in x's dtype."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((x_rot, x_pass), dim=-1).contiguous()


# -- sublayers ----------------------------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    """Weights of one main or refiner block in internal names without the block prefix, plus its LoRA residuals.

    tensors: `norm1.weight`, `attn.qkv.weight` (3I, H), `attn.norm_q.weight`, `attn.norm_k.weight`,
    `attn.out.weight` (H, I), `norm2.weight`, `ffn.in.weight` (2F, H; value then gate), `ffn.out.weight` (H, F).
    loras: linear name (`attn.qkv`, `attn.out`, `ffn.in`, `ffn.out`) -> residuals.
    """

    tensors: Mapping[str, torch.Tensor]
    loras: Mapping[str, tuple[LoraResidual, ...]]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def lora(self, name: str) -> tuple[LoraResidual, ...]:
        return self.loras.get(name, ())


def attention(
    h: torch.Tensor,
    w: LayerWeights,
    config: H3Config,
    attn_fn: AttentionFn,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """(1, S, H) normalised input -> (1, S, H) attention output (before the gate)."""
    inner = config.inner_dim
    qkv = linear(h, w["attn.qkv.weight"], loras=w.lora("attn.qkv"))
    q, k, v = (part.unflatten(-1, (config.num_attention_heads, -1)) for part in qkv.split(inner, dim=-1))
    q = rms_norm(q, w["attn.norm_q.weight"], config.qk_norm_eps)
    k = rms_norm(k, w["attn.norm_k.weight"], config.qk_norm_eps)
    if rotary is not None:
        q = apply_rotary(q, *rotary)
        k = apply_rotary(k, *rotary)
    out = attn_fn(q, k, v).flatten(2, 3).type_as(q)
    return linear(out, w["attn.out.weight"], loras=w.lora("attn.out"))


def feed_forward(h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """SwiGLU: `value * silu(gate)` from the fused [value; gate] projection, then the output projection."""
    value, gate = linear(h, w["ffn.in.weight"], loras=w.lora("ffn.in")).chunk(2, dim=-1)
    return linear(value * F.silu(gate), w["ffn.out.weight"], loras=w.lora("ffn.out"))


# -- text stream --------------------------------------------------------------------------------------------------


def text_stream(
    prompt_embeds: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    refiner: list[LayerWeights],
    config: H3Config,
    attn_fn: AttentionFn,
    aux_loras: Mapping[str, tuple[LoraResidual, ...]] = {},
) -> torch.Tensor:
    """(1, L, text_dim) -> (1, L, H) in the block dtype: context embedder, refiner blocks, final norm."""
    weight = aux["context_embedder.weight"]
    x = linear(prompt_embeds.to(weight.dtype), weight, aux["context_embedder.bias"], aux_loras.get("context_embedder", ()))
    for w in refiner:
        x = x + attention(rms_norm(x, w["norm1.weight"], config.norm_eps), w, config, attn_fn, rotary=None)
        x = x + feed_forward(rms_norm(x, w["norm2.weight"], config.norm_eps), w)
    return rms_norm(x, aux["refiner.final_norm.weight"], config.final_norm_eps)


# -- one evaluation -----------------------------------------------------------------------------------------------


@dataclass
class Modulation:
    """AdaLN rows of one block for one evaluation, gathered per packed row: six (S, H) tensors."""

    shift_msa: torch.Tensor
    scale_msa: torch.Tensor
    gate_msa: torch.Tensor
    shift_mlp: torch.Tensor
    scale_mlp: torch.Tensor
    gate_mlp: torch.Tensor

    @classmethod
    def gather(cls, table: torch.Tensor, adaln_indices: torch.Tensor) -> Modulation:
        """`table` (3T, 6H) as the reference's `adaln_proj` output viewed per (timestep, modality) row."""
        return cls(*(part.index_select(0, adaln_indices) for part in table.chunk(6, dim=-1)))


def main_block(x: torch.Tensor, w: LayerWeights, mod: Modulation, config: H3Config, attn_fn: AttentionFn, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One main block on the (1, S, H) residual stream."""
    h = rms_norm(x, w["norm1.weight"], config.norm_eps)
    h = h * (1.0 + mod.scale_msa) + mod.shift_msa
    x = x + mod.gate_msa * attention(h, w, config, attn_fn, rotary)
    h = rms_norm(x, w["norm2.weight"], config.norm_eps)
    h = h * (1.0 + mod.scale_mlp) + mod.shift_mlp
    return x + mod.gate_mlp * feed_forward(h, w)


def pack_inputs(
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    text: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    layout: Mapping[str, torch.Tensor],
    aux_loras: Mapping[str, tuple[LoraResidual, ...]] = {},
) -> torch.Tensor:
    """Project the latent rows and scatter them with the text rows into the (1, S, H) residual stream."""
    def project(rows: torch.Tensor, name: str) -> torch.Tensor:
        weight = aux[f"{name}.weight"]
        return linear(rows[None].to(weight.dtype), weight, aux[f"{name}.bias"], aux_loras.get(name, ()))

    video = project(video_rows, "proj_in")
    audio = project(audio_rows, "audio_proj_in")
    x = text.new_zeros((1, layout["token_tags"].shape[0], text.shape[-1]))
    x = x.index_copy(1, layout["text_indices"], text)
    x = x.index_copy(1, layout["video_indices"], video.to(text.dtype))
    return x.index_copy(1, layout["audio_indices"], audio.to(text.dtype))


def output_heads(
    x: torch.Tensor,
    norm_out_rows: torch.Tensor,
    timestep_indices: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    layout: Mapping[str, torch.Tensor],
    config: H3Config,
    aux_loras: Mapping[str, tuple[LoraResidual, ...]] = {},
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final modulated norm and the fp32 heads over every row, then the video / audio rows: (Nv, P), (Na, C)."""
    shift, scale = norm_out_rows.chunk(2, dim=-1)
    h = rms_norm(x, aux["norm_out.norm.weight"], config.final_norm_eps)
    h = h * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)
    h = h.to(aux["proj_out.weight"].dtype)
    video = linear(h, aux["proj_out.weight"], aux["proj_out.bias"], aux_loras.get("proj_out", ())).index_select(1, layout["video_indices"])
    audio = linear(h, aux["audio_proj_out.weight"], aux["audio_proj_out.bias"], aux_loras.get("audio_proj_out", ())).index_select(1, layout["audio_indices"])
    return video[0], audio[0]


def adaln_indices(timestep_indices: torch.Tensor, token_tags: torch.Tensor) -> torch.Tensor:
    """Packed row -> AdaLN table row: `timestep_index * 3 + modality tag`."""
    return timestep_indices * NUM_MODALITIES + token_tags


# -- timestep-dependent tables (computed by the compiler, once per fixed schedule) -------------------------------


def time_embedding(
    timesteps: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    config: H3Config,
    aux_loras: Mapping[str, tuple[LoraResidual, ...]] = {},
) -> torch.Tensor:
    """(T,) fp32 distinct timesteps in [0, 1] -> temb (T, time_embed_dim) in the time embedder's dtype (fp32).

    Sinusoidal embedding with cos first, no frequency shift and no x1000 scaling, then linear-SiLU-linear. The fp32
    `linear_2` GEMM is not row-invariant in T on cuBLAS, so tables must be built from exactly the vector the
    reference batches (see `schedule.distinct_timesteps`).
    """
    half = config.freq_dim // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device)
    frequencies = torch.exp(exponent / half)
    angles = timesteps[:, None].float() * frequencies[None, :]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    w1, w2 = aux["time_embedder.linear_1.weight"], aux["time_embedder.linear_2.weight"]
    h = linear(emb.to(w1.dtype), w1, aux["time_embedder.linear_1.bias"], aux_loras.get("time_embedder.linear_1", ()))
    return linear(F.silu(h), w2, aux["time_embedder.linear_2.bias"], aux_loras.get("time_embedder.linear_2", ()))


def adaln_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, loras: tuple[LoraResidual, ...] = ()) -> torch.Tensor:
    """One block's modulation table (3T, 6H): row `i * 3 + m` holds timestep i, modality m.

    SiLU runs at temb's precision and only its result is cast to the projection dtype.
    """
    table = linear(F.silu(temb).to(weight.dtype), weight, bias, loras)
    return table.view(-1, weight.shape[0] // NUM_MODALITIES)


def norm_out_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, loras: tuple[LoraResidual, ...] = ()) -> torch.Tensor:
    """Final-norm modulation (T, 2H): shift then scale, one row per timestep (no modality split)."""
    return linear(F.silu(temb).to(weight.dtype), weight, bias, loras)
