"""The MiniMax-H3 transformer, reference path: plain PyTorch over compiled weights and precomputed AdaLN tables.

This file is the numerical definition the fused kernels must reproduce. It follows diffusers 0.42.1
`MiniMaxH3Transformer3DModel` op for op, with three precomputations that change no bits:

* the AdaLN modulation rows and `norm_out` shift/scale come from the compiled schedule overlay (they depend on t only),
* the text stream (`context_embedder`, token refiner, final norm) is computed once per request (it depends on the
  prompt only),
* the rotary cos/sin are computed once per request (they depend on the layout only).

Every tensor keeps the batch axis of 1 the reference uses, so each torch call sees the reference's shapes. In bf16
every elementwise op rounds its own output (that rounding is part of the model); RMSNorm is `F.rms_norm`, which
multiplies by the weight in fp32 before its single rounding.

The block is written once (`main_block`) over a small set of operations (`BlockOps`): the methods here are the torch
reference of each operation; the fast path (`fused.FusedOps`) swaps in Triton kernels with the same roundings, a
sequence-head rank swaps the attention call, a tensor-parallel rank adds the reduction of partial projections.

Shapes: S packed rows, H hidden, I = heads * head_dim (inner), R rotary channels per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import NUM_MODALITIES, H3Config
from .profiler import NO_TIMER, StageTimer

__all__ = [
    "MODULATION_BLOCKS", "AttentionFn", "BlockOps", "LayerWeights", "LoraResidual", "ModulationBlocks",
    "RowScaledWeight", "adaln_indices", "adaln_table", "add_lora_residuals", "apply_rotary", "attention",
    "curve_adaln_table", "curve_norm_out_table", "curve_time_embedding", "feed_forward", "gated_residual", "linear",
    "main_block", "modulate", "modulation_rows", "norm_out_table", "output_heads", "pack_inputs", "qk_norm_rope",
    "rms_norm", "rms_norm_modulate", "rope", "rope_cos_sin", "rope_inv_freq", "sdpa_attention", "swiglu", "text_stream",
    "time_embedding",
]

# (B, S, heads, head_dim) q, k, v -> (B, S, heads, head_dim)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full, unmasked attention through `F.scaled_dot_product_attention`, called the way diffusers' native backend
    calls it."""
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), dropout_p=0.0, is_causal=False
    )
    return out.permute(0, 2, 1, 3)


@dataclass(frozen=True)
class LoraResidual:
    """One low-rank residual `scale * B(A(x))` added to a linear's output rows [row_start, row_stop).

    down: A (rank, in); up: B (rows, rank). The branch runs in the factors' dtype, as peft's unfused forward does.
    A full-rank delta (`diff`) has no up: down is the delta (rows, in) itself, as diffusers holds it (A = delta,
    B = identity, whose product is exact). bias: lora_B's bias (a `diff_b`), added before the scale as peft does.
    """

    down: torch.Tensor
    up: torch.Tensor | None
    scale: float
    row_start: int = 0
    bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int((self.down if self.up is None else self.up).shape[0])

    def to(self, device: torch.device) -> LoraResidual:
        return LoraResidual(
            self.down.to(device), None if self.up is None else self.up.to(device), self.scale, self.row_start,
            None if self.bias is None else self.bias.to(device),
        )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, loras: tuple[LoraResidual, ...] = ()
) -> torch.Tensor:
    """`F.linear` plus separate LoRA residuals; base weights are never modified."""
    return add_lora_residuals(F.linear(x, weight, bias), x, loras)


def add_lora_residuals(y: torch.Tensor, x: torch.Tensor, loras: tuple[LoraResidual, ...]) -> torch.Tensor:
    """A linear's output `y` of input `x` plus its LoRA residuals, each rounded into y's dtype (in place on a row
    range of y: `add_` computes and rounds as the out-of-place sum does, without a temporary and its copy back;
    whole-width residuals as a new tensor)."""
    for lora in loras:
        x_lora = x.to(lora.down.dtype)
        h = F.linear(x_lora, lora.down)
        if lora.up is not None:
            h = F.linear(h, lora.up, lora.bias)
        elif lora.bias is not None:  # B = identity: its GEMM with the bias is one rounding of h + bias
            h = h + lora.bias
        delta = h * lora.scale
        rows = slice(lora.row_start, lora.row_start + lora.rows)
        if rows.start == 0 and rows.stop == y.shape[-1]:
            y = (y + delta).to(y.dtype)
        else:
            y[..., rows].add_(delta)
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
    """Rotate-half over the leading R channels of every head of (..., S, heads, D); cos/sin (1, S, 1, R) in x's dtype.
    Also the video VAE decoder's rotary (`media.vae_vit`), over (W, S, heads, D) stacked tile-windows."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((x_rot, x_pass), dim=-1).contiguous()


# -- sublayers ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowScaledWeight:
    """The weight of one block linear in an FP8 artifact (approximate): E4M3 codes [out, in] and FP32 row scales
    [out, 1], weight ~ codes * scales. Only FP8 block operations (`fp8.RowFP8Ops`) take it."""

    codes: torch.Tensor
    scales: torch.Tensor


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

    def weight(self, linear: str) -> torch.Tensor | RowScaledWeight:
        """The weight operand of `linear` (`attn.qkv`, ...): its matrix, or in an FP8 artifact its E4M3 codes with
        their row scales (stored beside the codes as `<linear>.weight_scale`)."""
        scales = self.tensors.get(f"{linear}.weight_scale")
        if scales is None:
            return self.tensors[f"{linear}.weight"]
        return RowScaledWeight(self.tensors[f"{linear}.weight"], scales)


@dataclass(frozen=True)
class ModulationBlocks:
    """Where one sublayer's AdaLN parameters sit in a modulation table row: the H-wide block of each and how many
    blocks a row has."""

    shift: int
    scale: int
    gate: int | None  # the final norm has no gate
    count: int


#: The layout of the modulation tables, by sublayer; the fused ops (`fused.FusedOps`, `fp8.FusedRowFP8Ops`) pass its
#: blocks to the kernels, which know no layout of their own. Main-block tables are (3T, 6H) [shift, scale, gate] x
#: [attention "msa", FFN "mlp"]; the final norm's ("out") are (T, 2H) [shift, scale].
MODULATION_BLOCKS = {
    "msa": ModulationBlocks(shift=0, scale=1, gate=2, count=6),
    "mlp": ModulationBlocks(shift=3, scale=4, gate=5, count=6),
    "out": ModulationBlocks(shift=0, scale=1, gate=None, count=2),
}


def modulation_rows(table: torch.Tensor, row_index: torch.Tensor, which: str, part: int) -> torch.Tensor:
    """Rows of one AdaLN parameter (0 shift, 1 scale, 2 gate of `which`) for every packed row: (S, H)."""
    blocks = MODULATION_BLOCKS[which]
    block = (blocks.shift, blocks.scale, blocks.gate)[part]
    if block is None:
        raise ValueError(f"the {which!r} modulation table has no gate")
    return table.chunk(blocks.count, dim=-1)[block].index_select(0, row_index)


def modulate(normed: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str = "msa") -> torch.Tensor:
    """AdaLN modulation: `h * (1 + scale) + shift`, three roundings in bf16."""
    return normed * (1.0 + modulation_rows(table, row_index, which, 1)) + modulation_rows(table, row_index, which, 0)


def rms_norm_modulate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, row_index: torch.Tensor, which: str = "msa"
) -> torch.Tensor:
    return modulate(rms_norm(x, weight, eps), table, row_index, which)


def gated_residual(
    x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str = "msa"
) -> torch.Tensor:
    """`x + gate * y`: the gate's product rounds, then the sum."""
    return x + modulation_rows(table, row_index, which, 2) * y


def swiglu(p: torch.Tensor) -> torch.Tensor:
    """`value * silu(gate)` from the fused [value; gate] projection (`silu` rounds before the product)."""
    value, gate = p.chunk(2, dim=-1)
    return value * F.silu(gate)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q and k (1, S, heads, D); cos/sin (S, R) or (1, S, 1, R) in the blocks' dtype."""
    cos, sin = (t if t.dim() == 4 else t[None, :, None, :] for t in (cos, sin))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def qk_norm_rope(
    qkv: torch.Tensor, norm_q: torch.Tensor, norm_k: torch.Tensor, eps: float, cos: torch.Tensor | None,
    sin: torch.Tensor | None, *, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, S, 3I) fused projection -> q, k normalised per head (and rotated, unless cos is None), v a view:
    (1, S, heads, D)."""
    inner = qkv.shape[-1] // 3
    q, k, v = (part.unflatten(-1, (inner // head_dim, head_dim)) for part in qkv.split(inner, dim=-1))
    q, k = rms_norm(q, norm_q, eps), rms_norm(k, norm_k, eps)
    if cos is not None:
        assert sin is not None  # cos and sin come together
        q, k = rope(q, k, cos, sin)
    return q, k, v


class BlockOps:
    """The operations `main_block` is written in, as the torch reference (see the module docstring).

    `attention` attends (1, S, heads, D) q, k, v; `reduce` finishes a row-sharded output projection (identity on one
    device, an all-reduce across tensor-parallel ranks). `config` is the block's shape as this device sees it.
    """

    def __init__(
        self, config: H3Config, attention: AttentionFn, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ):
        self.config = config
        self.attention = attention
        self.reduce = reduce or (lambda partial: partial)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | RowScaledWeight, loras: tuple[LoraResidual, ...] = ()
    ) -> torch.Tensor:
        if isinstance(weight, RowScaledWeight):
            raise TypeError("an FP8 artifact's weights (codes + row scales) need FP8 block operations")
        return linear(x, weight, loras=loras)

    def norm_modulate(
        self, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str
    ) -> torch.Tensor:
        return rms_norm_modulate(x, weight, self.config.norm_eps, table, row_index, which)

    def qk_norm_rope(
        self, qkv: torch.Tensor, norm_q: torch.Tensor, norm_k: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = rotary or (None, None)
        return qk_norm_rope(
            qkv, norm_q, norm_k, self.config.qk_norm_eps, cos, sin, head_dim=self.config.attention_head_dim
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(1, S, heads, D) each -> (1, S, I) in q's dtype."""
        return self.attention(q, k, v).flatten(2, 3).type_as(q)

    def swiglu(self, p: torch.Tensor) -> torch.Tensor:
        return swiglu(p)

    def gated_residual(
        self, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str
    ) -> torch.Tensor:
        return gated_residual(x, y, table, row_index, which)


def attention(
    h: torch.Tensor, w: LayerWeights, ops: BlockOps, rotary: tuple[torch.Tensor, torch.Tensor] | None,
    timer: StageTimer = NO_TIMER
) -> torch.Tensor:
    """(1, S, H) normalised input -> (1, S, H) attention output (before the gate and any reduction)."""
    with timer.stage("qkv_projection"):
        qkv = ops.linear(h, w.weight("attn.qkv"), w.lora("attn.qkv"))
    with timer.stage("qk_norm_rope"):
        q, k, v = ops.qk_norm_rope(qkv, w["attn.norm_q.weight"], w["attn.norm_k.weight"], rotary)
    del qkv
    with timer.stage("attention"):
        out = ops.attend(q, k, v)
    del q, k, v
    with timer.stage("attention_output"):
        return ops.linear(out, w.weight("attn.out"), w.lora("attn.out"))


def feed_forward(h: torch.Tensor, w: LayerWeights, ops: BlockOps, timer: StageTimer = NO_TIMER) -> torch.Tensor:
    """SwiGLU from the fused [value; gate] projection, then the output projection (before the gate)."""
    with timer.stage("ffn_input"):
        p = ops.linear(h, w.weight("ffn.in"), w.lora("ffn.in"))
    with timer.stage("swiglu"):
        y = ops.swiglu(p)
    del p
    with timer.stage("ffn_output"):
        return ops.linear(y, w.weight("ffn.out"), w.lora("ffn.out"))


def main_block(
    x: torch.Tensor, w: LayerWeights, table: torch.Tensor, row_index: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor], ops: BlockOps,
    timer: StageTimer = NO_TIMER,
) -> torch.Tensor:
    """One main block on the (1, S, H) residual stream (a fused `gated_residual` updates it in place).

    `table` (3T, 6H) is this block's AdaLN table for the evaluation, `row_index` (S,) each row's table row. The
    attention's temporaries are released before the FFN runs, and the FFN keeps at most its input projection and its
    SwiGLU product alive at once.
    """
    with timer.stage("adaln_modulation"):
        h = ops.norm_modulate(x, w["norm1.weight"], table, row_index, "msa")
    y = attention(h, w, ops, rotary, timer)
    del h
    with timer.stage("attention_output"):
        x = ops.gated_residual(x, ops.reduce(y), table, row_index, "msa")
    del y
    with timer.stage("ffn_norm_modulation"):
        h = ops.norm_modulate(x, w["norm2.weight"], table, row_index, "mlp")
    y = feed_forward(h, w, ops, timer)
    del h
    with timer.stage("ffn_output"):
        return ops.gated_residual(x, ops.reduce(y), table, row_index, "mlp")


# -- text stream --------------------------------------------------------------------------------------------------


def text_stream(
    prompt_embeds: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    refiner: list[LayerWeights],
    ops: BlockOps,
    aux_loras: Mapping[str, tuple[LoraResidual, ...]] = {},
) -> torch.Tensor:
    """(1, L, text_dim) -> (1, L, H) in the block dtype: context embedder, refiner blocks (plain pre-norm, no rotary,
    no modulation), final norm. `ops` attends the whole prompt on this device."""
    config = ops.config
    weight = aux["context_embedder.weight"]
    x = linear(
        prompt_embeds.to(weight.dtype), weight, aux["context_embedder.bias"], aux_loras.get("context_embedder", ())
    )
    for w in refiner:
        x = x + attention(rms_norm(x, w["norm1.weight"], config.norm_eps), w, ops, rotary=None)
        x = x + feed_forward(rms_norm(x, w["norm2.weight"], config.norm_eps), w, ops)
    return rms_norm(x, aux["refiner.final_norm.weight"], config.final_norm_eps)


# -- one evaluation -----------------------------------------------------------------------------------------------


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
    """Final modulated norm and the fp32 heads over every row, then the video / audio rows: (Nv, P), (Na, C).

    The modulation runs in the table's dtype: bf16 (three roundings) for official weights, fp32 for a pruned file's
    fp32 table (the bf16 norm promoted, as ComfyUI core's final layer computes it for such a file).
    """
    h = rms_norm_modulate(x, aux["norm_out.norm.weight"], config.final_norm_eps, norm_out_rows, timestep_indices, "out")
    h = h.to(aux["proj_out.weight"].dtype)
    video = linear(
        h, aux["proj_out.weight"], aux["proj_out.bias"], aux_loras.get("proj_out", ())
    ).index_select(1, layout["video_indices"])
    audio = linear(
        h, aux["audio_proj_out.weight"], aux["audio_proj_out.bias"], aux_loras.get("audio_proj_out", ())
    ).index_select(1, layout["audio_indices"])
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


def adaln_table(
    temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, loras: tuple[LoraResidual, ...] = ()
) -> torch.Tensor:
    """One block's modulation table (3T, 6H): row `i * 3 + m` holds timestep i, modality m.

    SiLU runs at temb's precision and only its result is cast to the projection dtype.
    """
    table = linear(F.silu(temb).to(weight.dtype), weight, bias, loras)
    return table.view(-1, weight.shape[0] // NUM_MODALITIES)


def norm_out_table(
    temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, loras: tuple[LoraResidual, ...] = ()
) -> torch.Tensor:
    """Final-norm modulation (T, 2H): shift then scale, one row per timestep (no modality split)."""
    return linear(F.silu(temb).to(weight.dtype), weight, bias, loras)


# -- pruned files: the AdaLN of a reduced-rank time-embedding curve (approximate) ---------------------------------


def curve_time_embedding(timesteps: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(T,) fp32 timesteps -> (T, k) fp32 time embedding read from a pruned file's `adaln_t_table` (grid, k).

    The table holds the time-embedding curve at `grid` evenly spaced t in [0, 1], reduced to k directions; t (clamped
    to [0, 1]) is read by linear interpolation between the two rows around it, t = 1 at the end of the last interval.
    These are ComfyUI core's ops for such a file, in its order. The approximation against the full model is the rank
    k and the interpolation.
    """
    grid = table.shape[0]
    position = timesteps.clamp(0.0, 1.0) * (grid - 1)
    lower = position.floor().long().clamp(max=grid - 2)
    return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


def curve_adaln_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A pruned file's block modulation table (3T, 6H) in the blocks' `dtype`: its fp32 reduced-rank projection of the
    curve embedding, without SiLU, then one cast (core casts each row it uses to the stream's dtype)."""
    return F.linear(temb, weight, bias).view(-1, weight.shape[0] // NUM_MODALITIES).to(dtype)


def curve_norm_out_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A pruned file's final-norm modulation (T, 2H) in fp32, without SiLU; `output_heads` then modulates in fp32."""
    return F.linear(temb, weight, bias)
