"""LoRA adapters for H3 on internal linear names, as separate low-rank residuals or merged into the weights.

A residual leaves the base matrix as it is: each adapted linear adds `scale * B(A(x))` to its output rows, with
`scale = strength * alpha / rank` per module, as peft's unfused forward does. A stack (`LoraStack`: files, strengths,
mode) runs its adapters one after the other, or, merged, adds them into the weights at compile with peft's merge ops
(`merge_into`, what diffusers' `fuse_lora` computes). Accepted files (those diffusers' H3 LoRA loader accepts, and
more):

* diffusers / peft: `transformer.<module>.lora_A.weight` / `lora_B.weight` (or `transformer_ref.`), or an unprefixed
  peft dump with the `.default.` infix, over diffusers module names;
* original names (LightX2V, ai-toolkit, kohya, musubi): optional `diffusion_model.` or flattened `lora_unet_` prefix,
  `lora_down`/`lora_up` (+ per-module `.alpha`) or `lora_A`/`lora_B`, over `blocks.{i}.attn.qkv_proj`, `mlp.fc1`, ...;
* DiffSynth: original names with peft's `.default.` infix, trained on the raw per-head-interleaved QKV;
* ComfyUI's own saved LoRAs (`LoraSave`): original names under `diffusion_model.`, `lora_up`/`lora_down` without
  alpha, with `diff_b` bias deltas and `diff` deltas of the norms (all zero unless the norms were trained);
* full-rank deltas (FastH3 and ComfyUI's full_diff): `<module>.diff` [out, in] (+ `<module>.diff_b` [out]) over
  original names, applied as `strength * diff` as ComfyUI core does; diffusers holds such a delta as a LoRA with
  A = diff, B = identity and `lora_B.bias` = diff_b, which is what a residual computes (the identity GEMM is exact).

LoKr and LoHa files are refused naming the format (no H3 loader of diffusers takes them, so nothing exact to match;
ComfyUI core's generic weight adapters would, for a core MODEL).
A norm's `diff` is accepted only all zero (it then changes nothing); H3's linears in the blocks have no bias, so a
`diff_b` there does not fit.

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

__all__ = [
    "LORA_MODES", "TABLE_ONLY", "Adapter", "AdapterStack", "LoraStack", "StackedLora", "load_adapter", "merge_into",
]

#: How a LoRA stack runs: "residual" (separate low-rank residuals at every evaluation, peft's unfused forward) or
#: "merged" (added into the BF16 weights at compile as peft's `merge` / diffusers' `fuse_lora` does: no per-evaluation
#: cost).
LORA_MODES = ("residual", "merged")

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


class _Residuals:
    """Residuals per internal linear name, read per block or for the auxiliary linears."""

    residuals: dict[str, list[LoraResidual]]

    def for_prefix(self, prefix: str) -> dict[str, tuple[LoraResidual, ...]]:
        """Residuals of one block (`blocks.3`) keyed by the local linear name (`attn.qkv`)."""
        start = prefix + "."
        return {name[len(start) :]: tuple(rs) for name, rs in self.residuals.items() if name.startswith(start)}

    def aux(self) -> dict[str, tuple[LoraResidual, ...]]:
        return {name: tuple(rs) for name, rs in self.residuals.items() if not name.startswith(("blocks.", "refiner."))}


@dataclass
class Adapter(_Residuals):
    """A parsed LoRA file: residuals per internal linear name, and how its scale was determined."""

    path: Path
    format: str  # "diffusers", "original", "diffsynth" (ComfyUI's saved LoRAs and full-rank deltas are "original")
    alpha_source: str  # "tensor" (folded), "metadata", "none"
    network_alpha: float | None
    strength: float
    residuals: dict[str, list[LoraResidual]] = field(default_factory=dict)

    @property
    def ranks(self) -> dict[str, int]:
        """Rank of each low-rank linear (full-rank deltas have none)."""
        return {name: int(r.down.shape[0]) for name, rs in self.residuals.items() for r in rs[:1] if r.up is not None}


@dataclass
class AdapterStack(_Residuals):
    """Adapters applied in order to the same model: a linear's residuals are those of each adapter in stack order,
    as peft runs (and merges) its active adapters one after the other."""

    adapters: list[Adapter]
    mode: str = "residual"

    def __post_init__(self) -> None:
        self.residuals = {}
        for adapter in self.adapters:
            for name, rs in adapter.residuals.items():
                self.residuals.setdefault(name, []).extend(rs)
        self.residuals = dict(sorted(self.residuals.items()))

    @property
    def merged(self) -> bool:
        return self.mode == "merged"


@dataclass(frozen=True)
class StackedLora:
    """One LoRA file of a stack at its strength."""

    path: str
    strength: float = 1.0


@dataclass(frozen=True)
class LoraStack:
    """The LoRAs compiled with a profile after its own adapter (if it has one), in order, each at its strength, and how
    the whole stack, the profile's adapter included, runs (`LORA_MODES`). Part of a compile's identity: the files'
    identities, order, strengths and the mode are recorded in the receipt and the compiled manifest."""

    loras: tuple[StackedLora, ...] = ()
    mode: str = "residual"

    def __post_init__(self) -> None:
        if self.mode not in LORA_MODES:
            raise WeightFileError(f"LoRA mode must be one of {', '.join(LORA_MODES)}, got {self.mode!r}")
        bad = [lora.path for lora in self.loras if not is_number(lora.strength)]
        if bad:
            raise WeightFileError(f"LoRA strength must be a finite number: {', '.join(map(str, bad))}")

    @property
    def is_default(self) -> bool:
        """No LoRA beyond the profile's adapter, run as a residual: what a compile without a stack is."""
        return not self.loras and self.mode == "residual"


@torch.no_grad()
def merge_into(weight: torch.Tensor, bias: torch.Tensor | None, residuals: tuple[LoraResidual, ...]) -> None:
    """Add residuals into a linear's weight (and bias) in place, in order, with peft's `merge` ops (what diffusers'
    `fuse_lora` runs): the delta `B @ A` times the scale in B's dtype, except on the CPU for 16-bit factors in fp32
    rounded back to it; then the in-place add, rounded into the weight's dtype; a bias gets `bias * scale` likewise.
    A full-rank delta is B = identity: its product is A exactly."""
    for r in residuals:
        r = r.to(weight.device)
        dtype = (r.down if r.up is None else r.up).dtype
        in_fp32 = weight.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
        down = r.down.float() if in_fp32 else r.down
        product = down if r.up is None else (r.up.float() if in_fp32 else r.up) @ down
        delta = product * r.scale
        if in_fp32:
            delta = delta.to(dtype)
        weight[r.row_start : r.row_start + r.rows] += delta
        if r.bias is not None:
            assert bias is not None  # `_validate_shapes` refused a bias delta on a linear without a bias
            bias[r.row_start : r.row_start + r.rows] += r.bias * r.scale


def load_adapter(path: str | Path, config: H3Config, strength: float = 1.0) -> Adapter:
    """Parse a LoRA safetensors file onto the internal linear names of a model with `config`."""
    if not is_number(strength):
        raise WeightFileError(f"{path}: LoRA strength must be a finite number, got {strength!r}")
    store = TensorStore(path)
    _refuse_other_adapter_kinds(store.names, Path(path))
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
    for (target, part), module in pairs.items():
        down, up, bias = module.down, module.up, module.bias

        rows = down if up is None else up  # the factor holding the output rows, reordered as the weight's rows are
        # (output rows, first row in the linear, bias delta of those rows)
        parts: list[tuple[torch.Tensor, int, torch.Tensor | None]]
        if target.endswith("attn.qkv") and part is None:  # fused qkv_proj: shared A, B split in thirds
            if fmt == "diffsynth":
                d = config.attention_head_dim
                rows = rows.reshape(config.num_attention_heads, 3, d, -1).transpose(0, 1).reshape(3 * inner, -1)
            biases = [None] * 3 if bias is None else list(bias.chunk(3))
            parts = [(rows_k, k * inner, biases[k]) for k, rows_k in enumerate(rows.chunk(3))]
        elif target.endswith("attn.qkv"):
            assert part is not None  # the branch above took the fused qkv_proj
            parts = [(rows, part * inner, bias)]
        else:
            if target.endswith("ffn.in") and fmt != "diffusers":  # [gate; value] -> [value; gate]
                rows = torch.cat([rows[ffn:], rows[:ffn]])
                bias = None if bias is None else torch.cat([bias[ffn:], bias[:ffn]])
            parts = [(rows, 0, bias)]
        for rows_k, row_start, bias_k in parts:
            adapter.residuals.setdefault(target, []).append(_residual(
                down.clone() if len(parts) > 1 else down, None if up is None else rows_k, rows_k, network_alpha,
                strength, row_start, bias_k,
            ))
    adapter.residuals = {k: sorted(v, key=lambda r: r.row_start) for k, v in sorted(adapter.residuals.items())}
    _validate_shapes(adapter, config)
    return adapter


def _residual(
    down: torch.Tensor, up: torch.Tensor | None, rows: torch.Tensor, network_alpha: float | None, strength: float,
    row_start: int, bias: torch.Tensor | None,
) -> LoraResidual:
    """One residual from its output rows: B of a LoRA (`up`), or the rows of a full-rank delta (no up). Diffusers
    holds a delta as a LoRA of rank == alpha == its rows (A = delta, B = identity), so its scale is peft's
    `strength * alpha / rank` of those (`strength` up to rounding); a LoRA's is that of its own rank."""
    if up is None:
        n = rows.shape[0]
        return LoraResidual(rows.contiguous(), None, strength * float(n) / n, row_start, bias)
    rank = down.shape[0]
    alpha = network_alpha if network_alpha is not None else float(rank)
    return LoraResidual(down, up.contiguous(), strength * alpha / rank, row_start, bias)


@dataclass(frozen=True)
class _Module:
    """What a file holds for one adapted linear: A and B of a LoRA, or a full-rank delta as `down` with no `up`; and
    a bias delta (lora_B's bias, a `diff_b`)."""

    down: torch.Tensor
    up: torch.Tensor | None
    bias: torch.Tensor | None


# Tensor names of adapter kinds that are not LoRA or full-rank deltas (LyCORIS), by the format they name.
_OTHER_KINDS = {
    "LoKr": re.compile(r".*\.lokr_(w[12](_[ab])?|t[12])$"),
    "LoHa": re.compile(r".*\.hada_(w[12]_[ab]|t[12])$"),
}


def _refuse_other_adapter_kinds(names: list[str], path: Path) -> None:
    """LoKr and LoHa (LyCORIS) are refused naming the format: no H3 LoRA loader of diffusers takes them, so there is
    no diffusers result to be exact to (ComfyUI core's generic weight adapters apply them to a core MODEL, merged in
    fp32 with its own rounding). Keys of neither kind are left to the unknown-key report."""
    for kind in ("LoKr", "LoHa"):
        keys = sorted(n for n in names if _OTHER_KINDS[kind].match(n))
        if keys:
            raise WeightFileError(
                f"{path}: a {kind} (LyCORIS) file ({keys[0]}, {len(keys)} {kind} tensors): Vflash takes LoRA "
                "(lora_A/lora_B, lora_down/lora_up) and full-rank diff files, which it runs exactly as diffusers does; "
                "convert it to a LoRA or a diff"
            )


_FACTOR = re.compile(r".*\.(lora_(A|B|down|up)(\.default)?\.weight|diff)$")
# Vectors: lora_B's bias (diffusers), a bias delta, or a norm's delta (which is a `diff` of one dimension).
_VECTOR = re.compile(r".*\.(lora_B(\.default)?\.bias|diff_b|diff)$")


def _check_values(state: dict[str, torch.Tensor], path: Path) -> None:
    """Factors are non-empty finite float matrices (biases vectors) and each `.alpha` one positive finite number,
    checked before they are used (a 0-d factor has no rank; a NaN or infinite value would poison every output it
    touches; alpha <= 0 has no meaning and would never finish folding). Keys of neither kind are left to the
    unknown-key report."""
    problems = []
    for key, tensor in sorted(state.items()):
        if key.endswith(".alpha"):
            value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
            if value is None or not math.isfinite(value) or value <= 0:
                shown = f"shape {list(tensor.shape)}" if value is None else f"{value:g}"
                problems.append(f"{key} must be one positive finite number, got {shown}")
        elif _FACTOR.match(key) or _VECTOR.match(key):
            # a factor is a matrix, a bias a vector, a `diff` either (a linear's delta or a norm's)
            ndims = {2} if not _VECTOR.match(key) else {1} if not _FACTOR.match(key) else {1, 2}
            if tensor.ndim not in ndims or 0 in tensor.shape:
                kind = "matrix" if ndims == {2} else "vector" if ndims == {1} else "matrix or vector"
                problems.append(f"{key} must be a non-empty {kind}, got shape {list(tensor.shape)}")
            elif not tensor.is_floating_point():
                problems.append(f"{key} must hold floating-point values, got {tensor.dtype}")
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{key} holds NaN or infinite values")
    if problems:
        shown = "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        raise WeightFileError(f"{path}: LoRA file rejected: {shown}")


def _diffusers_pairs(state: dict[str, torch.Tensor], path: Path) -> dict[tuple[str, int | None], _Module]:
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        name = key.replace(".default.", ".")
        name = re.sub(r"^(transformer|transformer_ref)\.", "", name)
        match = re.fullmatch(r"(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias)", name)
        target = _target(match.group(1), _DIFFUSERS_AUX, _DIFFUSERS_BLOCKS, _DIFFUSERS_BLOCK) if match else None
        if target is None:
            unknown.append(key)
            continue
        assert match is not None  # a target comes from a match
        pairs.setdefault(target, {})[{"lora_A.weight": "A", "lora_B.weight": "B", "lora_B.bias": "bias"}[match[2]]] = (
            tensor
        )
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


_ORIGINAL_PARTS = {
    "lora_down.weight": "A", "lora_A.weight": "A", "lora_up.weight": "B", "lora_B.weight": "B", "alpha": "alpha",
    "diff": "diff", "diff_b": "bias",
}


def _original_pairs(
    state: dict[str, torch.Tensor], path: Path
) -> tuple[str, dict[tuple[str, int | None], _Module]]:
    state = {k.removeprefix("diffusion_model."): v for k, v in state.items()}
    fmt = "original"
    unknown = []
    if any(".lora_A.default." in k or ".lora_B.default." in k for k in state):
        fmt = "diffsynth"
        state = {k.replace(".default.", "."): v for k, v in state.items()}
    if any(k.startswith("lora_unet_") for k in state):
        unflat = {}
        for key, value in state.items():
            module, _, suffix = key.removeprefix("lora_unet_").partition(".")
            dotted = next((re.sub(p, r, module) for p, r in _MUSUBI_MODULES if re.fullmatch(p, module)), None)
            if dotted is None:
                unknown.append(key)
            else:
                unflat[f"{dotted}.{suffix}"] = value
        state = unflat
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = re.fullmatch(rf"(.+)\.({'|'.join(re.escape(p) for p in _ORIGINAL_PARTS)})", key)
        if not match:
            unknown.append(key)
            continue
        groups.setdefault(match.group(1), {})[_ORIGINAL_PARTS[match.group(2)]] = tensor
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    trained_norms = []
    for module, parts in groups.items():
        if set(parts) == {"diff"} and parts["diff"].ndim == 1:
            # a norm's delta (ComfyUI's LoraSave writes one per norm): all zero it changes nothing and is left out;
            # otherwise it is not applied, so the file is refused
            if bool(parts["diff"].any()):
                trained_norms.append(f"{module}.diff")
            continue
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
        folded = {"A": down, "B": up, "diff": parts.get("diff"), "bias": parts.get("bias")}
        pairs[target] = {k: v for k, v in folded.items() if v is not None}
    _raise_unknown(unknown, path)
    if trained_norms:
        raise WeightFileError(
            f"{path}: {len(trained_norms)} non-zero norm delta(s) that Vflash does not apply: "
            + ", ".join(sorted(trained_norms)[:12])
        )
    return fmt, _complete(pairs, path)


def _complete(pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]], path: Path) -> dict:
    """Each module holds A and B (a LoRA) or a `diff` (a full-rank delta), either with an optional bias delta."""
    modules, incomplete = {}, []
    for target, parts in pairs.items():
        weights = set(parts) - {"bias"}
        if weights == {"A", "B"}:
            modules[target] = _Module(parts["A"], parts["B"], parts.get("bias"))
        elif weights == {"diff"}:
            modules[target] = _Module(parts["diff"], None, parts.get("bias"))
        else:
            incomplete.append(str(target[0]) + ("" if target[1] is None else f"[{target[1]}]"))
    if incomplete:
        raise WeightFileError(
            f"{path}: LoRA modules without both down and up factors (or a diff): {', '.join(sorted(incomplete))}"
        )
    return modules


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
    # linears with a bias (a `diff_b` fits only these): the AdaLN projection and the auxiliary linears
    with_bias = {"adaln", *(name.removesuffix(".bias") for name in aux_shapes(config) if name.endswith(".bias"))}
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
            rows_fit = (
                r.down.shape[0] == fan_out if r.up is None
                else r.up.ndim == 2 and r.up.shape == (fan_out, r.down.shape[0])
            )
            fits = r.down.ndim == 2 and r.down.shape[1] == fan_in and rows_fit
            if not fits:
                shown = [list(r.down.shape)] if r.up is None else [list(r.down.shape), list(r.up.shape)]
                problems.append(f"{name}: factors {' / '.join(map(str, shown))} do not fit [{fan_out}, {fan_in}]")
            if r.bias is not None and (local not in with_bias or r.bias.shape != (fan_out,)):
                problems.append(
                    f"{name}: bias delta {list(r.bias.shape)} does not fit"
                    + (f" [{fan_out}]" if local in with_bias else " (the linear has no bias)")
                )
    if problems:
        raise WeightFileError(f"{adapter.path}: LoRA does not fit this model: " + "; ".join(problems[:8]))
