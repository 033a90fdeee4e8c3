"""Weights receipts: `prepare` binds a profile to the identities of the base weights, the adapter and a LoRA stack after
it (file names, sizes, sha256 of each payload, config; each LoRA's strength, in order, and the mode) in a receipt;
reading one back checks every field and, before a compile, the files against what it recorded (re-hashing only those
whose size or modification time changed since `prepare`). No request data is involved.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine.artifact import CompiledArtifact
from ..engine.config import H3Config
from ..errors import IdentityMismatchError, VflashError
from ..fileio import atomic_file, check_writable_destination, path_argument, read_text_file
from ..formats import (
    WEIGHTS_RECEIPT_FORMAT,
    Field,
    check_fields,
    field_problem,
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
from ..tensor_store import TensorStore, describe_files, file_sha256
from .checkpoint import SourceWeights
from .lora import LORA_MODES, Adapter, AdapterStack, LoraStack, load_adapter

__all__ = [
    "RECEIPT_FIELDS", "compile_identity", "compiled_from", "load_adapters", "load_receipt", "prepare",
    "profile_from_receipt", "receipt_describes", "verify_receipt_files",
]

# Progress stages (`StageProgress`), after each unit of work: "hash" (prepare, per weight file), "verify" (compile,
# per weight file). A callback that raises abandons the call; nothing is published then.

logger = logging.getLogger(__name__)

# Weight files hashed at once: enough to keep a fast disk and the page cache busy.
HASH_WORKERS = 8
#: A weights receipt lists names, sizes and hashes: a few hundred kilobytes at most; this bounds what is read.
MAX_RECEIPT_BYTES = 64 << 20


# -- prepare -----------------------------------------------------------------------------------------------------------

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
            "files": hash_files(source.files, progress),
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
    if not stack_applies(loras, with_adapter):
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


def stack_applies(loras: LoraStack | None, with_adapter: bool) -> bool:
    """Whether a stack changes the compile: a file in it, or the profile's adapter merged."""
    return loras is not None and not loras.is_default and (bool(loras.loras) or with_adapter)


def hash_files(paths: list[Path], progress: StageProgress | None) -> list[dict[str, object]]:
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


# -- reading a receipt back -------------------------------------------------------------------------------------------


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



def load_receipt(path: str | Path) -> dict:
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


def profile_from_receipt(receipt: dict, path: str | Path) -> Profile:
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


def verify_receipt_files(receipt: dict, source: SourceWeights, progress: StageProgress | None) -> None:
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
        if not unchanged(path, recorded[name]):
            changed.append(path)
    if changed:
        logger.info(
            "re-hashing %d of %d weight files whose modification time changed since prepare",
            len(changed), len(actual_files),
        )
    hashes = dict(zip(changed, hash_files(changed, None)))
    for done, (name, path) in enumerate(actual_files.items(), 1):
        if path in hashes and hashes[path]["sha256"] != recorded[name]["sha256"]:
            raise IdentityMismatchError(f"{path} does not match the receipt (sha256 changed since prepare)")
        if progress is not None:
            progress("verify", done, len(actual_files))
    if source.config.to_dict() != receipt["transformer"]["config"]:
        raise IdentityMismatchError("transformer config differs from the receipt")


def load_adapters(receipt: dict, profile: Profile, config: H3Config) -> AdapterStack | None:
    """The profile's adapter, then the receipt's LoRA stack, in order, each file checked against the receipt's record
    of it first; None where the receipt has neither."""
    adapter = None
    if receipt["adapter"] is not None:
        path = Path(receipt["adapter"]["path"])
        _check_recorded_file(path, receipt["adapter"], "adapter")
        adapter = load_adapter(path, config, profile.adapter.strength)  # type: ignore[union-attr]
    return _load_stack(receipt, adapter, config)


def _check_recorded_file(path: Path, record: dict, what: str) -> None:
    """`path` is the file the receipt records: present, and unchanged since (its size and mtime, else its sha256)."""
    if not path.is_file() or not unchanged(path, record) and file_sha256(path) != record["sha256"]:
        raise IdentityMismatchError(f"{what} {path} does not match the receipt (missing, or size or sha256 changed)")

def _load_stack(receipt: dict, adapter: Adapter | None, config: H3Config) -> AdapterStack | None:
    """`adapter`, then the receipt's LoRA stack (checked by `load_receipt`; each file against its record), in order."""
    record = receipt.get("loras")
    if record is None:
        return None if adapter is None else AdapterStack([adapter])
    adapters = [] if adapter is None else [adapter]
    for lora in record["files"]:
        path = Path(lora["path"])
        _check_recorded_file(path, lora, "LoRA")
        adapters.append(load_adapter(path, config, lora["strength"]))
    return AdapterStack(adapters, record["mode"])


def unchanged(path: Path, record: dict) -> bool:
    """Same size and modification time as when `prepare` hashed it (see `verify_receipt_files`)."""
    stat = path.stat()
    return stat.st_size == record["size"] and stat.st_mtime_ns == record.get("mtime_ns")


def receipt_describes(
    receipt_path: str | Path, transformer: str | Path, adapter: str | Path | None, loras: LoraStack | None = None
) -> bool:
    """Whether a weights receipt was prepared from these very files as they are now: the same paths, file names,
    sizes and modification times (only the receipt, the files' metadata and their safetensors headers are read), and
    the same LoRA stack (files, order, strengths, mode). False for a receipt that cannot be read."""
    try:
        receipt = load_receipt(receipt_path)
        files = TensorStore(transformer).files
    except VflashError:
        return False
    recorded = {f["name"]: f for f in receipt["transformer"]["files"]}
    if (
        receipt["transformer"]["path"] != str(Path(transformer).resolve())
        or set(recorded) != {f.path.name for f in files}
    ):
        return False
    if not all(unchanged(f.path, recorded[f.path.name]) for f in files):
        return False
    stack = receipt.get("loras")
    if (stack is not None) != stack_applies(loras, adapter is not None):
        return False
    if stack is not None:
        assert loras is not None  # a stack applies
        wanted = [(str(Path(lora.path).resolve()), lora.strength) for lora in loras.loras]
        if (
            stack.get("mode") != loras.mode or [(f.get("path"), f.get("strength")) for f in stack["files"]] != wanted
            or not all(Path(f["path"]).is_file() and unchanged(Path(f["path"]), f) for f in stack["files"])
        ):
            return False
    if adapter is None or receipt["adapter"] is None:
        return adapter is None and receipt["adapter"] is None
    return (
        receipt["adapter"]["path"] == str(Path(adapter).resolve())
        and Path(adapter).is_file()
        and unchanged(Path(adapter), receipt["adapter"])
    )


def compiled_from(folder: str | Path, receipt_path: str | Path) -> bool:
    """Whether the compile in `folder` was made for the receipt's profile from the weights it hashed (their names,
    sizes and sha256, and the adapter's). False for a compile or a receipt that cannot be read."""
    folder = Path(folder)
    try:
        receipt = load_receipt(receipt_path)
        profile = profile_from_receipt(receipt, receipt_path)
        artifact = CompiledArtifact(folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors")
    except VflashError:
        return False
    identity = compile_identity(profile, receipt, artifact.config, artifact.arch, artifact.compile_id)
    compiled = {
        "profile_id": artifact.profile_id, "profile": artifact.profile_record, "adapter": artifact.adapter,
        "loras": artifact.loras,
    }
    return all(compiled[key] == identity.get(key) for key in compiled) and (
        artifact.base_weights.get("files") == identity["base_weights"]["files"])  # type: ignore[index]


def compile_identity(
    profile: Profile, receipt: dict, config: H3Config, arch: str, compile_id: str
) -> dict[str, object]:
    """What a compile of this receipt for `profile` on `arch` records of where it came from (its manifests'
    identity): the profile, the config and the identities of the files, not where or when they were written."""
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
