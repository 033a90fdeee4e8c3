"""What `compile` writes into its folder from checked sources: the packed blocks (`artifact/`), the auxiliary tensors
and the schedule overlay (`schedule/`), each with its manifest (see `compiler` for the layout)."""

from __future__ import annotations

import json
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engine import model as M
from ..engine.artifact import TABLE_INPUTS
from ..engine.config import block_shapes
from ..engine.fp8 import FP8_LINEARS, quantize_block
from ..errors import VflashError
from ..formats import ARTIFACT_FORMAT, ARTIFACT_FP8_FORMAT, OVERLAY_FORMAT
from ..profiles import Profile
from ..progress import StageProgress
from ..schedule import distinct_timesteps
from ..tensor_store import write_safetensors
from .checkpoint import SourceWeights
from .lora import TABLE_ONLY, AdapterStack, merge_into
from .receipt import compile_identity

__all__ = ["write_compiled"]

# Progress stage (`StageProgress`): "compile", after each block. A callback that raises abandons the call.

logger = logging.getLogger(__name__)

# Blocks read ahead of / written behind the table GEMMs: enough to keep a fast disk and the page cache busy, few
# enough to bound host memory (~1.3 GB per full-size block).
READ_AHEAD_BLOCKS = 2
WRITE_BEHIND_BLOCKS = 4


@dataclass
class _Tables:
    """The schedule overlay as it is filled: per (step, vector) its temb, and the tensors and entries written."""

    not_applied: list[str]  # LoRA modules feeding only the tables, which do not apply to a pruned file
    tembs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    overlay: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: list[dict[str, object]] = field(default_factory=list)


@dataclass
class _Blocks:
    """The block files written, each block's LoRA records, and (FP8 profile) how many linears kept the file's codes."""

    files: list[dict[str, object]]
    lora_records: list[list[dict[str, object]]]
    kept_codes: int


@torch.no_grad()
def write_compiled(
    out: Path,
    source: SourceWeights,
    adapter: AdapterStack | None,
    profile: Profile,
    receipt: dict,
    device: torch.device,
    arch: str,
    progress: StageProgress | None,
) -> None:
    """Write the compile of `source` (with `adapter`) for `profile` into the new folder `out`."""
    config = source.config
    compile_id = uuid.uuid4().hex
    identity = compile_identity(profile, receipt, config, arch, compile_id)
    artifact_format = ARTIFACT_FP8_FORMAT if profile.fp8 else ARTIFACT_FORMAT
    (out / "artifact").mkdir()
    (out / "schedule").mkdir()
    tables = _time_tables(source, adapter, profile, device)
    blocks = _write_blocks(out, source, adapter, profile, device, tables, artifact_format, compile_id, progress)
    aux_file = _write_auxiliary(out, source, adapter, device, artifact_format, compile_id, identity)

    schedule = profile.schedule
    tables.overlay["video_sigmas"], tables.overlay["audio_sigmas"] = schedule.video_sigmas, schedule.audio_sigmas
    overlay_file = _save_hashed(
        tables.overlay, out / "schedule" / "overlay.safetensors", {"format": OVERLAY_FORMAT, "compile_id": compile_id}
    )
    fp8_linears = config.num_layers * len(FP8_LINEARS)
    artifact_manifest = {
        "format": artifact_format,
        **identity,
        **({"fp8": _fp8_record(source.format, blocks.kept_codes, fp8_linears)} if profile.fp8 else {}),
        "adapter_not_applied": tables.not_applied,
        "blocks": [{"file": f["name"], "lora": r, **f} for f, r in zip(blocks.files, blocks.lora_records)],
        "auxiliary": aux_file,
    }
    (out / "artifact" / "manifest.json").write_text(json.dumps(artifact_manifest, indent=2) + "\n")
    overlay_manifest = {
        "format": OVERLAY_FORMAT,
        **{k: identity[k] for k in ("compile_id", "profile_id", "profile", "arch")},
        "schedule": schedule.to_dict(),
        "num_layers": config.num_layers,
        "entries": tables.entries,
        "file": overlay_file,
    }
    (out / "schedule" / "manifest.json").write_text(json.dumps(overlay_manifest, indent=2) + "\n")


def _time_tables(
    source: SourceWeights, adapter: AdapterStack | None, profile: Profile, device: torch.device
) -> _Tables:
    """temb and the `norm_out` table for every (step, vector), into the overlay; the blocks' tables follow.

    Tables first need temb for every (step, vector); the time embedder (or a pruned file's curve table) is small
    and read once. A pruned file's tables follow ComfyUI core for that file: the curve read by interpolation, fp32
    projections without SiLU, block rows cast to the blocks' dtype. A LoRA's modules feeding only the tables do not
    fit its reduced-rank projections (core skips them with a shape warning); they are left out and recorded.
    """
    pruned = source.pruned
    table_aux = {k: v.to(device) for k, v in source.read_aux(lambda n: n.startswith(TABLE_INPUTS)).items()}
    not_applied = sorted(n for n in adapter.residuals if TABLE_ONLY.match(n)) if adapter and pruned else []
    if not_applied:
        logger.warning(
            "%d LoRA module(s) feed the AdaLN tables and do not apply to a pruned file; left out", len(not_applied)
        )
    # Merged: every adapted linear's weight (and bias) gets the stack added as peft's merge does, on the compile
    # device, before anything is computed from it; no residual is left. Residual: the tables fold the residuals in.
    aux_loras = {
        k: tuple(r.to(device) for r in rs) for k, rs in (adapter.aux() if adapter and not pruned else {}).items()
    }
    if adapter is not None and adapter.merged:
        for name, residuals in aux_loras.items():
            if TABLE_ONLY.match(name):
                merge_into(table_aux[f"{name}.weight"], table_aux[f"{name}.bias"], residuals)
        aux_loras = {}
    tables = _Tables(not_applied)
    for s, step_vectors in enumerate(_timestep_vectors(profile)):
        for v, vector in enumerate(step_vectors):
            key = f"step{s:03d}.v{v}"
            if pruned:
                temb = M.curve_time_embedding(vector.to(device), table_aux["adaln_t_table"])
                norm_out = M.curve_norm_out_table(
                    temb, table_aux["norm_out.linear.weight"].float(), table_aux["norm_out.linear.bias"].float()
                )
            else:
                temb = M.time_embedding(vector.to(device), table_aux, source.config, aux_loras)
                norm_out = M.norm_out_table(
                    temb, table_aux["norm_out.linear.weight"], table_aux["norm_out.linear.bias"],
                    aux_loras.get("norm_out.linear", ()),
                )
            tables.tembs.append((s, v, temb))
            tables.overlay[f"{key}.timesteps"] = vector
            tables.overlay[f"{key}.temb"] = temb.cpu()
            tables.overlay[f"{key}.norm_out"] = norm_out.cpu()
            tables.entries.append({"step": s, "variant": v, "timesteps": vector.tolist()})
    return tables


def _read_block(
    source: SourceWeights, profile: Profile, i: int
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Block i's tensors with its adaln_proj, and for an FP8 profile the linears the file stores as E4M3 codes (kept
    as they are: codes and per-tensor scales, never dequantized)."""
    names = list(block_shapes(source.config, f"blocks.{i}", with_adaln=True))
    kept = [
        f"blocks.{i}.{linear}.weight"
        for linear in FP8_LINEARS
        if profile.fp8 and source.stores_e4m3(f"blocks.{i}.{linear}.weight")
    ]
    codes = {name.split(".", 2)[2].removesuffix(".weight"): pair for name, pair in source.read_codes(kept).items()}
    return source.read([n for n in names if n not in kept]), codes


def _write_blocks(
    out: Path, source: SourceWeights, adapter: AdapterStack | None, profile: Profile, device: torch.device,
    tables: _Tables, artifact_format: str, compile_id: str, progress: StageProgress | None,
) -> _Blocks:
    """Every block's AdaLN tables into the overlay, and its packed file into `artifact/`.

    Blocks stream through: source reads run READ_AHEAD_BLOCKS ahead of the table GEMMs, and each packed block is
    serialised, hashed and written by a writer thread behind them, so reading, the device and writing overlap and
    no more than a few blocks are in host memory at once.
    """
    num_layers = source.config.num_layers
    reader = ThreadPoolExecutor(READ_AHEAD_BLOCKS)
    writer = ThreadPoolExecutor(WRITE_BEHIND_BLOCKS)
    reads: dict[int, Future] = {
        i: reader.submit(_read_block, source, profile, i) for i in range(min(READ_AHEAD_BLOCKS, num_layers))
    }
    writes: list[Future] = []
    lora_records: list[list[dict[str, object]]] = []
    kept_codes = 0  # FP8 profile: block linears whose E4M3 codes and scales come from the file as stored
    try:
        for i in tqdm(range(num_layers), desc="compile blocks", unit="block"):
            block, stored_codes = reads.pop(i).result()
            kept_codes += len(stored_codes)
            if i + READ_AHEAD_BLOCKS < num_layers:
                reads[i + READ_AHEAD_BLOCKS] = reader.submit(_read_block, source, profile, i + READ_AHEAD_BLOCKS)
            tensors, lora_tensors, records = _pack_block(
                i, block, stored_codes, source, adapter, profile, device, tables
            )
            lora_records.append(records)
            while sum(not w.done() for w in writes) >= WRITE_BEHIND_BLOCKS:
                writes[[w.done() for w in writes].index(False)].result()
            path = out / "artifact" / f"block_{i:03d}.safetensors"
            writes.append(writer.submit(
                _save_hashed, {**tensors, **lora_tensors}, path, {"format": artifact_format, "compile_id": compile_id}
            ))
            del block, tensors, lora_tensors
            if progress is not None:
                progress("compile", i + 1, num_layers)
        block_files = [w.result() for w in writes]
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True, cancel_futures=True)
    return _Blocks(block_files, lora_records, kept_codes)


def _pack_block(
    i: int, block: dict[str, torch.Tensor], stored_codes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    source: SourceWeights, adapter: AdapterStack | None, profile: Profile, device: torch.device, tables: _Tables,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, object]]]:
    """Block i's AdaLN table for every (step, vector) into the overlay (its adaln_proj taken out of `block`); returns
    its packed tensors (any merged stack added in, FP8 profile quantized), its LoRA factors and their records."""
    pruned, merged = source.pruned, adapter is not None and adapter.merged
    weight, bias = block.pop(f"blocks.{i}.adaln.weight").to(device), block.pop(f"blocks.{i}.adaln.bias").to(device)
    block_loras = adapter.for_prefix(f"blocks.{i}") if adapter else {}
    adaln_loras = tuple(r.to(device) for r in block_loras.pop("adaln", ()))
    if merged:
        if not pruned:
            merge_into(weight, bias, adaln_loras)
        adaln_loras = ()
    block_dtype = source.dtype_of("refiner.final_norm.weight")
    for s, v, temb in tables.tembs:
        if pruned:
            table = M.curve_adaln_table(temb, weight.float(), bias.float(), block_dtype)
        else:
            table = M.adaln_table(temb, weight, bias, adaln_loras)
        tables.overlay[f"step{s:03d}.v{v}.block{i:03d}"] = table.cpu()
    del weight, bias
    tensors = {k.split(".", 2)[2]: t for k, t in block.items()}
    if merged:
        tensors.update(_merged_linears(tensors, block_loras, device, set(stored_codes)))
        block_loras = {}
    if profile.fp8:
        tensors = quantize_block(tensors, device, stored_codes)
    lora_tensors, records = _lora_tensors(block_loras)
    return tensors, lora_tensors, records


def _write_auxiliary(
    out: Path, source: SourceWeights, adapter: AdapterStack | None, device: torch.device, artifact_format: str,
    compile_id: str, identity: dict[str, object],
) -> dict[str, object]:
    """The auxiliary tensors (and the refiner's blocks) with the LoRA factors the runtime applies, or merged in."""
    config = source.config
    aux = source.read_aux(lambda n: not n.startswith(TABLE_INPUTS))
    refiner = [
        n for j in range(config.num_refiner_layers) for n in block_shapes(config, f"refiner.{j}", with_adaln=False)
    ]
    aux.update(source.read(refiner))  # the refiner's final norm is an aux tensor, read above
    runtime_loras = {}
    if adapter:
        runtime_loras = {k: v for k, v in adapter.aux().items() if not TABLE_ONLY.match(k)}
        for j in range(config.num_refiner_layers):
            runtime_loras.update({f"refiner.{j}.{k}": v for k, v in adapter.for_prefix(f"refiner.{j}").items()})
    if adapter is not None and adapter.merged:
        aux.update(_merged_linears(aux, runtime_loras, device, set()))
        runtime_loras = {}
    lora_tensors, aux_lora_records = _lora_tensors(runtime_loras)
    aux_meta = {
        "format": artifact_format, "compile_id": compile_id, "identity": json.dumps(identity),
        "lora": json.dumps(aux_lora_records),
    }
    return _save_hashed({**aux, **lora_tensors}, out / "auxiliary.safetensors", aux_meta)


def _timestep_vectors(profile: Profile) -> list[list[torch.Tensor]]:
    """Per step, the distinct fp32 timestep vectors requests of this profile present (deduplicated by value)."""
    schedule = profile.schedule
    vectors = []
    for t_v, t_a in zip(schedule.video_timesteps.tolist(), schedule.audio_timesteps.tolist()):
        step: list[torch.Tensor] = []
        for conditioned, ref_audio in profile.timestep_kinds():
            v = distinct_timesteps(t_v, t_a, conditioned, ref_audio)
            if not any(torch.equal(v, seen) for seen in step):
                step.append(v)
        vectors.append(step)
    return vectors


def _merged_linears(
    tensors: dict[str, torch.Tensor], loras: dict[str, tuple[M.LoraResidual, ...]], device: torch.device,
    stored_codes: set[str],
) -> dict[str, torch.Tensor]:
    """The weights (and biases) of the adapted linears with their residuals merged (`lora.merge_into`) on the compile
    device, as new CPU tensors. An FP8 profile's linear kept as the file's E4M3 codes has no BF16 weight to merge
    into: refused."""
    kept = sorted(set(loras) & stored_codes)
    if kept:
        raise VflashError(
            f"a merged LoRA stack needs BF16 weights, but {', '.join(kept)} are kept as the file's FP8 codes; compile "
            "the stack as residuals, or from a BF16 file"
        )
    out = {}
    for name, residuals in loras.items():
        weight = tensors[f"{name}.weight"].to(device, copy=True)
        bias = tensors[f"{name}.bias"].to(device, copy=True) if f"{name}.bias" in tensors else None
        merge_into(weight, bias, residuals)
        out[f"{name}.weight"] = weight.cpu()
        if bias is not None:
            out[f"{name}.bias"] = bias.cpu()
    return out


def _lora_tensors(
    residuals: dict[str, tuple[M.LoraResidual, ...]],
) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
    """Flatten residuals to safetensors entries `lora.<linear>.<k>.{down,up}` plus their scale/row records."""
    tensors, records = {}, []
    for name, rs in residuals.items():
        for k, r in enumerate(rs):
            tensors[f"lora.{name}.{k}.down"] = r.down.contiguous()
            record: dict[str, object] = {"linear": name, "index": k, "scale": r.scale, "row_start": r.row_start}
            if r.up is None:  # a full-rank delta; records of low-rank factors stay as they were
                record["up"] = False
            else:
                tensors[f"lora.{name}.{k}.up"] = r.up.contiguous()
            if r.bias is not None:
                tensors[f"lora.{name}.{k}.bias"] = r.bias.contiguous()
                record["bias"] = True
            records.append(record)
    return tensors, records


def _save_hashed(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict[str, object]:
    """Write a safetensors file and return its identity record, hashed as it is written (never read back)."""
    size, sha256 = write_safetensors(path, tensors, metadata)
    return {"name": path.name, "size": size, "sha256": sha256}


def _fp8_record(source_format: str, kept: int, total: int) -> dict[str, object]:
    """What an FP8 artifact's manifest says of its block linears: where the codes and scales come from."""
    scales = {
        "quantized": "float32 [out, 1] = row absmax / 448 of the source weights",
        "kept": "float32 [out, 1] = the file's per-tensor weight_scale repeated per row; codes as stored",
    }
    origin = "kept" if kept == total else "quantized" if kept == 0 else "mixed"
    return {
        "linears": list(FP8_LINEARS), "codes": "float8_e4m3fn", "source_format": source_format, "origin": origin,
        "kept_linears": kept, "quantized_linears": total - kept,
        "scales": (
            scales[origin] if origin != "mixed"
            else f"{scales['kept']} ({kept} linears); {scales['quantized']} ({total - kept})"
        ),
    }
