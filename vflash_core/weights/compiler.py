"""The weights compiler: H3 weights (+ LoRA) -> packed blocks, auxiliary tensors and a schedule overlay.

Verbs (`python -m vflash_core.weights.compiler prepare|compile|verify`):

* `prepare` binds a profile to the identities of the base weights and the adapter (file names, sizes, sha256 of
  each payload, config), and of a LoRA stack after it (each file's identity and strength, in order, and the mode:
  residual or merged), in a receipt. No request data is involved.
* `compile` checks the files against the receipt (re-hashing only those whose size or modification time changed
  since `prepare`), then writes, atomically, a folder with

  - `artifact/`: one `block_NNN.safetensors` per main block: the unchanged matrices in their stored dtype with the
    fused QKV `[3*inner, H]` and fused SwiGLU input `[2*ffn, H]` (a merged stack added in), plus the block's LoRA
    factors (residual mode); no `adaln_proj`
    (39 % of the model) — the runtime never loads it;
  - `auxiliary.safetensors`: input projections, context embedder, token refiner, final norm and output heads (plus
    their LoRA factors);
  - `schedule/overlay.safetensors`: for every step of the profile's fixed schedule and every distinct-timestep vector
    a request of the profile can present, `temb`, each block's AdaLN table and the `norm_out` shift/scale, computed
    on the target device from exactly that vector (the fp32 `time_embedder` GEMM is not row-invariant), with any
    LoRA on `adaln_proj`, `time_embedder` or `norm_out` folded in (a pruned file, for a -pruned profile: from its
    `adaln_t_table` curve and reduced-rank projections, see `model.curve_time_embedding`);
  - a `manifest.json` in `artifact/` and `schedule/` (and metadata in the auxiliary file) carrying one compile id,
    the profile identity, the config, the device architecture, the base weights' form (`format`: "bf16", or
    "fp8_scaled" / "int8_convrot" / "int8" / "gguf", dequantized as it is read, with `quant_types` and the
    `dequantized` line saying how; `pruned`) and the size and sha256 of every file.

  For an FP8 profile (approximate, `Profile.fp8`) the artifact is of its own kind (`ARTIFACT_FP8_FORMAT`): each
  block's four linears are quantized on the compile device to E4M3 codes (`<linear>.weight`) with FP32 row scales
  (`<linear>.weight_scale`, [out, 1]) by `fp8.quantize_block`; everything else is the BF16 artifact's. From an
  fp8_scaled file the linears it stores as E4M3 are not quantized again: its codes are copied as they are and its
  per-tensor scale repeated per row (`SourceWeights.read_codes`); the manifest's `fp8` record says which
  (`source_format`, `origin`: "kept", "quantized" or "mixed").

Loading (see `artifact.py`) checks format, compile id, identities and sizes, and never rehashes the model; `verify`
re-hashes a compiled folder against the sha256 of every file recorded as it was written.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import sys
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engine import model as M
from ..engine.artifact import TABLE_INPUTS, CompiledArtifact
from ..engine.config import H3Config, block_shapes
from ..engine.fp8 import FP8_LINEARS, quantize_block
from ..errors import IdentityMismatchError, VflashError, run_command
from ..fileio import (
    atomic_directory,
    atomic_file,
    check_folder,
    check_new_directory,
    check_writable_destination,
    path_argument,
    read_text_file,
)
from ..formats import (
    ARTIFACT_FORMAT,
    ARTIFACT_FP8_FORMAT,
    GPU_INDEX,
    OVERLAY_FORMAT,
    WEIGHTS_RECEIPT_FORMAT,
    Field,
    check_device,
    check_fields,
    device_arch,
    field_problem,
    gpu_device,
    is_count,
    is_file_name,
    is_number,
    is_object,
    is_positive,
    is_text,
    list_of,
)
from ..profiles import AdapterSpec, Profile, get_profile
from ..progress import StageProgress
from ..schedule import distinct_timesteps
from ..tensor_store import TensorStore, describe_files, file_sha256, write_safetensors
from .checkpoint import SourceWeights
from .lora import LORA_MODES, TABLE_ONLY, Adapter, AdapterStack, LoraStack, StackedLora, load_adapter, merge_into

__all__ = ["build_parser", "compile_receipt", "compiled_from", "main", "prepare", "receipt_describes"]

# Progress stages (`StageProgress`), after each unit of work: "hash" (prepare, per weight file), "verify" (compile,
# per weight file), "compile" (per block). A callback that raises abandons the call; nothing is published then.

logger = logging.getLogger(__name__)

# Weight files hashed at once by `prepare`, and blocks read ahead of / written behind the table GEMMs by `compile`:
# enough to keep a fast disk and the page cache busy, few enough to bound host memory (~1.3 GB per full-size block).
HASH_WORKERS = 8
READ_AHEAD_BLOCKS = 2
WRITE_BEHIND_BLOCKS = 4
#: A weights receipt lists names, sizes and hashes: a few hundred kilobytes at most; this bounds what is read.
MAX_RECEIPT_BYTES = 64 << 20


# -- prepare ------------------------------------------------------------------------------------------------------


def prepare(
    profile: Profile | str,
    transformer: str | Path,
    receipt: str | Path,
    adapter: str | Path | None = None,
    qkv_layout: str | None = None,
    progress: StageProgress | None = None,
    loras: LoraStack | None = None,
) -> dict[str, object]:
    """Write a receipt binding `profile` to the base weights, its adapter and a LoRA stack after it (`loras`: files,
    strengths, mode; each file hashed and parsed now, so a file that does not fit is refused here); returns it."""
    profile = get_profile(profile)
    transformer = path_argument(transformer, "the transformer")
    adapter = None if adapter is None else path_argument(adapter, "the adapter")
    receipt = check_writable_destination(path_argument(receipt, "the receipt path"))
    source = SourceWeights(transformer, qkv_layout=qkv_layout)
    source.check_profile(profile)
    if profile.adapter is None and adapter is not None:
        raise IdentityMismatchError(f"profile {profile.id} uses no adapter, but {adapter} was given")
    if profile.adapter is not None and adapter is None:
        raise IdentityMismatchError(
            f"profile {profile.id} needs adapter {profile.adapter.file_name} ({profile.adapter.name})"
        )
    adapter_record = None
    if adapter is not None:
        adapter = Path(adapter)
        assert profile.adapter is not None  # refused above otherwise
        parsed = load_adapter(adapter, source.config, profile.adapter.strength)
        _check_adapter_against_profile(profile, adapter, parsed)
        adapter_record = {
            "path": str(adapter.resolve()),
            **describe_files([adapter], with_hash=True)[0],
            "format": parsed.format,
            "alpha_source": parsed.alpha_source,
            "network_alpha": parsed.network_alpha,
            "ranks": sorted(set(parsed.ranks.values())),
        }
    stack_record = _stack_record(loras, adapter is not None, source.config)
    folder = Path(transformer)
    record = {
        "format": WEIGHTS_RECEIPT_FORMAT,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "profile": profile.to_dict(),
        "transformer": {
            "path": str(folder.resolve()),
            "layout": source.layout,
            "qkv_layout": source.qkv_layout,
            **source.describe(),
            "config": source.config.to_dict(),
            "files": _hash_files(source.files, progress),
        },
        "adapter": adapter_record,
        # only where there is a stack: receipts (and compiles) without one are as they were
        **({"loras": stack_record} if stack_record is not None else {}),
    }
    text = json.dumps(record, indent=2) + "\n"
    with atomic_file(receipt) as tmp:
        tmp.write_text(text)
    return json.loads(text)


def _stack_record(loras: LoraStack | None, with_adapter: bool, config: H3Config) -> dict[str, object] | None:
    """The receipt's record of a LoRA stack: its mode and each file's identity, strength and how its scale was read;
    None where there is nothing to record (no stack, or one that changes nothing: no file, residual mode, or no LoRA
    at all to merge)."""
    if not _stack_applies(loras, with_adapter):
        return None
    assert loras is not None  # a stack applies
    files = []
    for lora in loras.loras:
        path = path_argument(lora.path, "a LoRA of the stack")
        parsed = load_adapter(path, config, lora.strength)
        files.append({
            "path": str(Path(path).resolve()), **describe_files([Path(path)], with_hash=True)[0],
            "strength": lora.strength, "format": parsed.format, "alpha_source": parsed.alpha_source,
            "network_alpha": parsed.network_alpha,
        })
    return {"mode": loras.mode, "files": files}


def _stack_applies(loras: LoraStack | None, with_adapter: bool) -> bool:
    """Whether a stack changes the compile: a file in it, or the profile's adapter merged."""
    return loras is not None and not loras.is_default and (bool(loras.loras) or with_adapter)


def _hash_files(paths: list[Path], progress: StageProgress | None) -> list[dict[str, object]]:
    """Hash the weight files, several at once; `progress` is told after each file, in order."""
    records = []
    with ThreadPoolExecutor(min(HASH_WORKERS, max(1, len(paths)))) as pool:
        for done, record in enumerate(pool.map(lambda path: describe_files([path], with_hash=True)[0], paths), 1):
            records.append(record)
            if progress is not None:
                progress("hash", done, len(paths))
    return records


def _check_adapter_against_profile(profile: Profile, path: Path, adapter: Adapter) -> None:
    spec = profile.adapter
    assert spec is not None
    problems = []
    if path.name != spec.file_name:
        problems.append(f"file name {path.name!r} (profile expects {spec.file_name!r})")
    # Published H3 LoRAs are mixed-rank (e.g. 64 on attention/FFN, 16 on AdaLN); the profile pins the block rank.
    ranks = {rank for name, rank in adapter.ranks.items() if re.search(r"\.(attn|ffn)\.", name)}
    if ranks != {spec.rank}:
        problems.append(f"attention/FFN ranks {sorted(ranks)} (profile expects {spec.rank})")
    alpha = adapter.network_alpha if adapter.alpha_source == "metadata" else None
    if alpha is not None and alpha != spec.alpha:
        problems.append(f"metadata alpha {alpha:g} (profile expects {spec.alpha:g})")
    if problems:
        raise IdentityMismatchError(
            f"adapter {path} does not match profile {profile.id} ({spec.name}): " + "; ".join(problems)
        )


# -- compile ------------------------------------------------------------------------------------------------------


_FILE_RECORD: tuple[Field, ...] = (
    ("name", "a file name", is_file_name), ("size", "a byte count", is_count), ("sha256", "a hex digest", is_text),
)
_ADAPTER_SPEC: tuple[Field, ...] = (
    ("name", "a string", is_text), ("file_name", "a file name", is_file_name), ("alpha", "a number", is_number),
    ("rank", "a positive integer", is_positive), ("strength", "a number", is_number),
)
# What `compile_receipt` reads from a weights receipt, with what each must be.
RECEIPT_FIELDS: tuple[Field, ...] = (
    ("profile.id", "a profile id", is_text),
    ("profile.modes", "a list of mode names", lambda v: isinstance(v, list) and all(is_text(m) for m in v)),
    ("profile.variant", "a partition name", is_text),
    ("profile.adapter", "null or an adapter record", lambda v: v is None or not field_problem(v, _ADAPTER_SPEC)),
    ("profile.nfe", "a positive integer", is_positive),
    *((f"profile.{k}", "a number", is_number) for k in ("video_shift", "audio_shift", "min_seconds", "max_seconds")),
    ("profile.arch", "an architecture tag", is_text),
    ("transformer", "an object", is_object),
    ("transformer.path", "a path string", is_text),
    ("transformer.layout", "'diffusers' or 'original'", lambda v: v in ("diffusers", "original")),
    ("transformer.qkv_layout", "a QKV layout name", is_text),
    ("transformer.config", "an object", is_object),
    ("transformer.files", "a list of {name, size, sha256} records", list_of(*_FILE_RECORD)),
    (
        "adapter", "null or a {path, name, size, sha256, format, alpha_source, network_alpha} record",
        lambda v: v is None or not field_problem(v, (
            ("path", "", is_text), *_FILE_RECORD, ("format", "", is_text), ("alpha_source", "", is_text),
            ("network_alpha", "", lambda a: a is None or is_number(a)),
        )),
    ),
)


_STACK_FIELDS: tuple[Field, ...] = (
    ("loras.mode", "a LoRA mode (residual or merged)", lambda v: v in LORA_MODES),
    ("loras.files", "a list of {path, name, size, sha256, strength, format, alpha_source, network_alpha} records",
     list_of(
         ("path", "", is_text), *_FILE_RECORD, ("strength", "", is_number), ("format", "", is_text),
         ("alpha_source", "", is_text), ("network_alpha", "", lambda a: a is None or is_number(a)),
     )),
)


def _load_receipt(path: str | Path) -> dict:
    if not os.path.lexists(path):
        raise VflashError(f"{path}: no such receipt")
    text = read_text_file(path, "receipt", MAX_RECEIPT_BYTES)  # a folder, FIFO or binary file is named as such
    try:
        receipt = json.loads(text)
    except (ValueError, RecursionError):
        raise VflashError(f"{path}: corrupt receipt (not JSON)") from None
    if not isinstance(receipt, dict) or receipt.get("format") != WEIGHTS_RECEIPT_FORMAT:
        found = receipt.get("format") if isinstance(receipt, dict) else None
        raise VflashError(
            f"{path}: not a Vflash receipt (format {found!r}); "
            "write one with `python -m vflash_core.weights.compiler prepare`"
        )
    check_fields(
        receipt, RECEIPT_FIELDS, f"receipt {path}",
        "write it again with `python -m vflash_core.weights.compiler prepare`",
    )
    if "loras" in receipt:  # a LoRA stack, only where there is one
        check_fields(
            receipt, _STACK_FIELDS, f"receipt {path}",
            "write it again with `python -m vflash_core.weights.compiler prepare`",
        )
    return receipt


def _profile_from_receipt(receipt: dict, path: str | Path) -> Profile:
    data = dict(receipt["profile"])
    data["modes"] = tuple(data["modes"])
    data["adapter"] = AdapterSpec(**{k: data["adapter"][k] for k, _, _ in _ADAPTER_SPEC}) if data["adapter"] else None
    fields = {f.name for f in dataclasses.fields(Profile)}
    profile = Profile(**{k: v for k, v in data.items() if k in fields})
    try:
        registered = get_profile(profile.id)
    except VflashError:
        registered = None
    if registered is not None and registered != profile:
        raise IdentityMismatchError(
            f"{path}: receipt profile {profile.id} differs from the registered profile of that name; prepare again"
        )
    return profile


def _verify_receipt_files(receipt: dict, source: SourceWeights, progress: StageProgress | None) -> None:
    """The payloads must be exactly the ones the receipt hashed.

    A file whose size and modification time are still the ones `prepare` recorded is the file it hashed (weights
    are immutable; anything that rewrites a file changes its mtime), so it is not read again; any other file is
    re-hashed against the receipt. A full-size model is thus hashed once on its first use, not twice.
    """
    recorded = {f["name"]: f for f in receipt["transformer"]["files"]}
    actual_files = {p.name: p for p in source.files}
    if set(recorded) != set(actual_files):
        raise IdentityMismatchError(
            f"transformer files {sorted(actual_files)} differ from the receipt's {sorted(recorded)}"
        )
    changed = []
    for name, path in actual_files.items():
        if path.stat().st_size != recorded[name]["size"]:
            raise IdentityMismatchError(f"{path} does not match the receipt (size changed since prepare)")
        if not _unchanged(path, recorded[name]):
            changed.append(path)
    if changed:
        logger.info(
            "re-hashing %d of %d weight files whose modification time changed since prepare",
            len(changed), len(actual_files),
        )
    hashes = dict(zip(changed, _hash_files(changed, None)))
    for done, (name, path) in enumerate(actual_files.items(), 1):
        if path in hashes and hashes[path]["sha256"] != recorded[name]["sha256"]:
            raise IdentityMismatchError(f"{path} does not match the receipt (sha256 changed since prepare)")
        if progress is not None:
            progress("verify", done, len(actual_files))
    if source.config.to_dict() != receipt["transformer"]["config"]:
        raise IdentityMismatchError("transformer config differs from the receipt")


def compile_receipt(
    receipt_path: str | Path, output: str | Path, device: str = "cpu", progress: StageProgress | None = None
) -> Path:
    """Compile the receipt's weights for its profile into `output` (must not exist). Returns `output`."""
    receipt_path, output = path_argument(receipt_path, "the receipt"), path_argument(output, "the output folder")
    receipt = _load_receipt(receipt_path)
    profile = _profile_from_receipt(receipt, receipt_path)

    device_t = check_device(device, profile.arch, profile_id=profile.id)  # before anything is read
    arch = device_arch(device_t)
    output = check_new_directory(output)  # before the weights are read and hashed
    tx = receipt["transformer"]
    source = SourceWeights(tx["path"], qkv_layout=None if tx["layout"] == "diffusers" else tx["qkv_layout"])
    source.check_profile(profile)
    _verify_receipt_files(receipt, source, progress)
    adapter = None
    if receipt["adapter"] is not None:
        adapter_path = Path(receipt["adapter"]["path"])
        if (
            not adapter_path.is_file()
            or not _unchanged(adapter_path, receipt["adapter"])
            and file_sha256(adapter_path) != receipt["adapter"]["sha256"]
        ):
            raise IdentityMismatchError(
                f"adapter {adapter_path} does not match the receipt (missing, or size or sha256 changed)"
            )
        adapter = load_adapter(adapter_path, source.config, profile.adapter.strength)  # type: ignore[union-attr]
    stack = _load_stack(receipt, adapter, source.config)
    with atomic_directory(output) as tmp:
        _write_compiled(tmp, source, stack, profile, receipt, device_t, arch, progress)
    logger.info("compiled %s for %s into %s", tx["path"], profile.id, output)
    return output


def _load_stack(receipt: dict, adapter: Adapter | None, config: H3Config) -> AdapterStack | None:
    """The profile's adapter, then the receipt's LoRA stack (checked by `_load_receipt`; each file against its hash),
    in order."""
    record = receipt.get("loras")
    if record is None:
        return None if adapter is None else AdapterStack([adapter])
    adapters = [] if adapter is None else [adapter]
    for lora in record["files"]:
        path = Path(lora["path"])
        if not path.is_file() or not _unchanged(path, lora) and file_sha256(path) != lora["sha256"]:
            raise IdentityMismatchError(f"LoRA {path} does not match the receipt (missing, or size or sha256 changed)")
        adapters.append(load_adapter(path, config, lora["strength"]))
    return AdapterStack(adapters, record["mode"])


def receipt_describes(
    receipt_path: str | Path, transformer: str | Path, adapter: str | Path | None, loras: LoraStack | None = None
) -> bool:
    """Whether a weights receipt was prepared from these very files as they are now: the same paths, file names,
    sizes and modification times (only the receipt, the files' metadata and their safetensors headers are read), and
    the same LoRA stack (files, order, strengths, mode). False for a receipt that cannot be read."""
    try:
        receipt = _load_receipt(receipt_path)
        files = TensorStore(transformer).files
    except VflashError:
        return False
    recorded = {f["name"]: f for f in receipt["transformer"]["files"]}
    if (
        receipt["transformer"]["path"] != str(Path(transformer).resolve())
        or set(recorded) != {f.path.name for f in files}
    ):
        return False
    if not all(_unchanged(f.path, recorded[f.path.name]) for f in files):
        return False
    stack = receipt.get("loras")
    if (stack is not None) != _stack_applies(loras, adapter is not None):
        return False
    if stack is not None:
        assert loras is not None  # a stack applies
        wanted = [(str(Path(lora.path).resolve()), lora.strength) for lora in loras.loras]
        if (
            stack.get("mode") != loras.mode or [(f.get("path"), f.get("strength")) for f in stack["files"]] != wanted
            or not all(Path(f["path"]).is_file() and _unchanged(Path(f["path"]), f) for f in stack["files"])
        ):
            return False
    if adapter is None or receipt["adapter"] is None:
        return adapter is None and receipt["adapter"] is None
    return (
        receipt["adapter"]["path"] == str(Path(adapter).resolve())
        and Path(adapter).is_file()
        and _unchanged(Path(adapter), receipt["adapter"])
    )


def compiled_from(folder: str | Path, receipt_path: str | Path) -> bool:
    """Whether the compile in `folder` was made for the receipt's profile from the weights it hashed (their names,
    sizes and sha256, and the adapter's). False for a compile or a receipt that cannot be read."""
    folder = Path(folder)
    try:
        receipt = _load_receipt(receipt_path)
        profile = _profile_from_receipt(receipt, receipt_path)
        artifact = CompiledArtifact(folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors")
    except VflashError:
        return False
    identity = _identity(profile, receipt, artifact.config, artifact.arch, artifact.compile_id)
    compiled = {
        "profile_id": artifact.profile_id, "profile": artifact.profile_record, "adapter": artifact.adapter,
        "loras": artifact.loras,
    }
    return all(compiled[key] == identity.get(key) for key in compiled) and (
        artifact.base_weights.get("files") == identity["base_weights"]["files"])  # type: ignore[index]


def _identity(profile: Profile, receipt: dict, config: H3Config, arch: str, compile_id: str) -> dict[str, object]:
    return {
        "compile_id": compile_id,
        "profile_id": profile.id,
        "profile": profile.identity(),
        "config": config.to_dict(),
        "arch": arch,
        "base_weights": {
            "layout": receipt["transformer"]["layout"],
            **{
                k: receipt["transformer"][k]
                for k in ("format", "quantized_layers", "pruned", "quant_types", "dequantized")
                if k in receipt["transformer"]
            },
            # what identifies a file's content, not where or when it was written
            "files": [{k: f[k] for k in ("name", "size", "sha256")} for f in receipt["transformer"]["files"]],
        },
        "adapter": None if receipt["adapter"] is None else {
            k: receipt["adapter"][k] for k in ("name", "size", "sha256", "format", "alpha_source", "network_alpha")
        },
        # the stack after the adapter, in order, and its mode; absent without one (identities as they were)
        **({"loras": {
            "mode": receipt["loras"]["mode"],
            "files": [
                {k: f[k] for k in ("name", "size", "sha256", "strength", "format", "alpha_source", "network_alpha")}
                for f in receipt["loras"]["files"]
            ],
        }} if "loras" in receipt else {}),
        "torch": torch.__version__,
    }


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


def _unchanged(path: Path, record: dict) -> bool:
    """Same size and modification time as when `prepare` hashed it (see `_verify_receipt_files`)."""
    stat = path.stat()
    return stat.st_size == record["size"] and stat.st_mtime_ns == record.get("mtime_ns")


def _save_hashed(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict[str, object]:
    """Write a safetensors file and return its identity record, hashed as it is written (never read back)."""
    size, sha256 = write_safetensors(path, tensors, metadata)
    return {"name": path.name, "size": size, "sha256": sha256}


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


@torch.no_grad()
def _write_compiled(
    out: Path,
    source: SourceWeights,
    adapter: AdapterStack | None,
    profile: Profile,
    receipt: dict,
    device: torch.device,
    arch: str,
    progress: StageProgress | None,
) -> None:
    config = source.config
    compile_id = uuid.uuid4().hex
    identity = _identity(profile, receipt, config, arch, compile_id)
    artifact_format = ARTIFACT_FP8_FORMAT if profile.fp8 else ARTIFACT_FORMAT
    (out / "artifact").mkdir()
    (out / "schedule").mkdir()

    # Tables first need temb for every (step, vector); the time embedder (or a pruned file's curve table) is small
    # and read once. A pruned file's tables follow ComfyUI core for that file: the curve read by interpolation, fp32
    # projections without SiLU, block rows cast to the blocks' dtype. A LoRA's modules feeding only the tables do not
    # fit its reduced-rank projections (core skips them with a shape warning); they are left out and recorded.
    pruned = source.pruned
    table_aux = {k: v.to(device) for k, v in source.read_aux(lambda n: n.startswith(TABLE_INPUTS)).items()}
    not_applied = sorted(n for n in adapter.residuals if TABLE_ONLY.match(n)) if adapter and pruned else []
    if not_applied:
        logger.warning(
            "%d LoRA module(s) feed the AdaLN tables and do not apply to a pruned file; left out", len(not_applied)
        )
    # Merged: every adapted linear's weight (and bias) gets the stack added as peft's merge does, on the compile
    # device, before anything is computed from it; no residual is left. Residual: the tables fold the residuals in.
    merged = adapter is not None and adapter.merged
    aux_loras = {
        k: tuple(r.to(device) for r in rs) for k, rs in (adapter.aux() if adapter and not pruned else {}).items()
    }
    if merged:
        for name, residuals in aux_loras.items():
            if TABLE_ONLY.match(name):
                merge_into(table_aux[f"{name}.weight"], table_aux[f"{name}.bias"], residuals)
        aux_loras = {}
    block_dtype = source.dtype_of("refiner.final_norm.weight")
    vectors = _timestep_vectors(profile)
    overlay: dict[str, torch.Tensor] = {}
    entries = []
    tembs = []
    for s, step_vectors in enumerate(vectors):
        for v, vector in enumerate(step_vectors):
            key = f"step{s:03d}.v{v}"
            if pruned:
                temb = M.curve_time_embedding(vector.to(device), table_aux["adaln_t_table"])
                norm_out = M.curve_norm_out_table(
                    temb, table_aux["norm_out.linear.weight"].float(), table_aux["norm_out.linear.bias"].float()
                )
            else:
                temb = M.time_embedding(vector.to(device), table_aux, config, aux_loras)
                norm_out = M.norm_out_table(
                    temb, table_aux["norm_out.linear.weight"], table_aux["norm_out.linear.bias"],
                    aux_loras.get("norm_out.linear", ()),
                )
            tembs.append((s, v, temb))
            overlay[f"{key}.timesteps"] = vector
            overlay[f"{key}.temb"] = temb.cpu()
            overlay[f"{key}.norm_out"] = norm_out.cpu()
            entries.append({"step": s, "variant": v, "timesteps": vector.tolist()})

    # Blocks stream through: source reads run READ_AHEAD_BLOCKS ahead of the table GEMMs, and each packed block is
    # serialised, hashed and written by a writer thread behind them, so reading, the device and writing overlap and
    # no more than a few blocks are in host memory at once.
    reader = ThreadPoolExecutor(READ_AHEAD_BLOCKS)
    writer = ThreadPoolExecutor(WRITE_BEHIND_BLOCKS)
    def read(i: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Block i's tensors with its adaln_proj, and for an FP8 profile the linears the file stores as E4M3 codes
        (kept as they are: codes and per-tensor scales, never dequantized)."""
        names = list(block_shapes(config, f"blocks.{i}", with_adaln=True))
        kept = [
            f"blocks.{i}.{linear}.weight"
            for linear in FP8_LINEARS
            if profile.fp8 and source.stores_e4m3(f"blocks.{i}.{linear}.weight")
        ]
        codes = {name.split(".", 2)[2].removesuffix(".weight"): pair for name, pair in source.read_codes(kept).items()}
        return source.read([n for n in names if n not in kept]), codes

    reads: dict[int, Future] = {i: reader.submit(read, i) for i in range(min(READ_AHEAD_BLOCKS, config.num_layers))}
    writes: list[Future] = []
    lora_records: list[list[dict[str, object]]] = []
    kept_codes = 0  # FP8 profile: block linears whose E4M3 codes and scales come from the file as stored
    try:
        for i in tqdm(range(config.num_layers), desc="compile blocks", unit="block"):
            block, stored_codes = reads.pop(i).result()
            kept_codes += len(stored_codes)
            if i + READ_AHEAD_BLOCKS < config.num_layers:
                reads[i + READ_AHEAD_BLOCKS] = reader.submit(read, i + READ_AHEAD_BLOCKS)
            weight, bias = (
                block.pop(f"blocks.{i}.adaln.weight").to(device), block.pop(f"blocks.{i}.adaln.bias").to(device)
            )
            block_loras = adapter.for_prefix(f"blocks.{i}") if adapter else {}
            adaln_loras = tuple(r.to(device) for r in block_loras.pop("adaln", ()))
            if merged:
                if not pruned:
                    merge_into(weight, bias, adaln_loras)
                adaln_loras = ()
            for s, v, temb in tembs:
                if pruned:
                    table = M.curve_adaln_table(temb, weight.float(), bias.float(), block_dtype)
                else:
                    table = M.adaln_table(temb, weight, bias, adaln_loras)
                overlay[f"step{s:03d}.v{v}.block{i:03d}"] = table.cpu()
            del weight, bias
            tensors = {k.split(".", 2)[2]: t for k, t in block.items()}
            if merged:
                tensors.update(_merged_linears(tensors, block_loras, device, set(stored_codes)))
                block_loras = {}
            if profile.fp8:
                tensors = quantize_block(tensors, device, stored_codes)
            lora_tensors, records = _lora_tensors(block_loras)
            lora_records.append(records)
            while sum(not w.done() for w in writes) >= WRITE_BEHIND_BLOCKS:
                writes[[w.done() for w in writes].index(False)].result()
            path = out / "artifact" / f"block_{i:03d}.safetensors"
            writes.append(writer.submit(
                _save_hashed, {**tensors, **lora_tensors}, path, {"format": artifact_format, "compile_id": compile_id}
            ))
            del block, tensors, lora_tensors
            if progress is not None:
                progress("compile", i + 1, config.num_layers)
        block_files = [w.result() for w in writes]
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True, cancel_futures=True)

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
    if merged:
        aux.update(_merged_linears(aux, runtime_loras, device, set()))
        runtime_loras = {}
    lora_tensors, aux_lora_records = _lora_tensors(runtime_loras)
    aux_meta = {
        "format": artifact_format, "compile_id": compile_id, "identity": json.dumps(identity),
        "lora": json.dumps(aux_lora_records),
    }
    aux_file = _save_hashed({**aux, **lora_tensors}, out / "auxiliary.safetensors", aux_meta)

    schedule = profile.schedule
    overlay["video_sigmas"], overlay["audio_sigmas"] = schedule.video_sigmas, schedule.audio_sigmas
    overlay_file = _save_hashed(
        overlay, out / "schedule" / "overlay.safetensors", {"format": OVERLAY_FORMAT, "compile_id": compile_id}
    )

    artifact_manifest = {
        "format": artifact_format,
        **identity,
        **(
            {"fp8": _fp8_record(source.format, kept_codes, config.num_layers * len(FP8_LINEARS))} if profile.fp8 else {}
        ),
        "adapter_not_applied": not_applied,
        "blocks": [{"file": f["name"], "lora": r, **f} for f, r in zip(block_files, lora_records)],
        "auxiliary": aux_file,
    }
    (out / "artifact" / "manifest.json").write_text(json.dumps(artifact_manifest, indent=2) + "\n")
    overlay_manifest = {
        "format": OVERLAY_FORMAT,
        **{k: identity[k] for k in ("compile_id", "profile_id", "profile", "arch")},
        "schedule": schedule.to_dict(),
        "num_layers": config.num_layers,
        "entries": entries,
        "file": overlay_file,
    }
    (out / "schedule" / "manifest.json").write_text(json.dumps(overlay_manifest, indent=2) + "\n")


# -- command line ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vflash_core.weights.compiler", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="bind a profile to base weights (and adapter) in a receipt")
    p.add_argument(
        "--profile", required=True, help="profile id the weights are compiled for, e.g. t2va-base16-bf16-sm90"
    )
    p.add_argument(
        "--transformer", required=True,
        help="diffusers transformer/ folder, or an original-layout file/folder (Comfy-Org bf16, fp8_scaled, "
        "int8_convrot or pruned single files, and GGUF files, too)",
    )
    p.add_argument("--adapter", help="LoRA .safetensors the profile is built with")
    p.add_argument(
        "--lora", action="append", default=[], metavar="FILE[:STRENGTH]", type=_stacked_lora,
        help="a LoRA stacked after the profile's adapter (repeat, in order; strength 1 unless given)",
    )
    p.add_argument(
        "--lora-mode", choices=LORA_MODES, default="residual",
        help="residual: separate low-rank residuals at every evaluation (as peft adapters); merged: added into the "
        "weights at compile (as fuse_lora), no per-evaluation cost",
    )
    p.add_argument("--qkv-layout", choices=("stacked", "interleaved"), help="original layout only (default stacked)")
    p.add_argument("--receipt", required=True, help="receipt JSON to write (must not exist)")
    c = sub.add_parser("compile", help="compile a receipt into artifact/, schedule/ and auxiliary.safetensors")
    c.add_argument("--receipt", required=True, help="receipt written by `prepare`")
    c.add_argument(
        "--output", required=True, help="folder to write (must not exist): artifact/, schedule/, auxiliary.safetensors"
    )
    c.add_argument("--device", default="cpu", help="cpu or cuda:N (the profile's architecture)")
    c.add_argument("--gpu", type=GPU_INDEX.option("--gpu"), help="shorthand for --device cuda:N")
    v = sub.add_parser("verify", help="re-hash a compiled folder against the sha256 recorded when it was written")
    v.add_argument("compiled", help="folder holding artifact/, schedule/ and auxiliary.safetensors")
    return parser


def _stacked_lora(text: str) -> StackedLora:
    """FILE or FILE:STRENGTH (the last colon, where what follows is a number: a path may hold colons)."""
    path, _, strength = text.rpartition(":")
    try:
        return StackedLora(path, float(strength)) if path else StackedLora(text)
    except ValueError:
        return StackedLora(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()

    def run() -> None:
        args = parser.parse_args(argv)  # inside: a refused number is a one-line error too
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        _run(args)

    return run_command(run, "error: ", "interrupted; nothing was published")


def _run(args: argparse.Namespace) -> None:
    if args.command == "prepare":
        prepare(
            args.profile, args.transformer, args.receipt, args.adapter, args.qkv_layout,
            loras=LoraStack(tuple(args.lora), args.lora_mode),
        )
        print(f"wrote receipt {args.receipt}")
    elif args.command == "verify":
        folder = check_folder(
            args.compiled, hint="give the folder compile wrote (artifact/, schedule/, auxiliary.safetensors)"
        )
        CompiledArtifact(folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors").verify()
        print(f"{folder}: every file matches the sha256 recorded at compile time")
    else:
        out = compile_receipt(args.receipt, args.output, gpu_device(args.gpu, args.device))
        print(f"compiled into {out}: artifact/, schedule/, auxiliary.safetensors")


if __name__ == "__main__":
    sys.exit(main())
