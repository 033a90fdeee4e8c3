"""Loading a compiled artifact: format, identity and size checks (no rehash; `verify` re-hashes on request), then
reads.

The three outputs of one compile (`artifact/`, `schedule/`, `auxiliary.safetensors`) are passed separately on the
command line, so each carries the compile id and they must agree; each file's size must be the one recorded when it
was hashed at compile time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import IdentityMismatchError, VflashError, WeightFileError
from ..fileio import path_argument, read_json
from ..formats import (
    ARTIFACT_FORMAT,
    ARTIFACT_FP8_FORMAT,
    OVERLAY_FORMAT,
    Field,
    check_fields,
    is_count,
    is_file_name,
    is_number,
    is_object,
    is_positive,
    is_text,
    list_of,
)
from ..memory_plan import PartSizes
from ..profiles import Profile, check_identity
from ..tensor_store import TensorStore, file_sha256
from .config import H3Config, aux_shapes, block_shapes
from .fp8 import FP8_LINEARS
from .model import LayerWeights, LoraResidual
from .weight_io import SequentialWeights

__all__ = ["FLOAT_DTYPES", "TABLE_INPUTS", "CompiledArtifact", "CompiledPaths", "ScheduleOverlay", "StepTables"]

# The dtypes a floating-point tensor of a checkpoint or an artifact may have.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32, torch.float16)
# Internal names that feed only the AdaLN tables (compiled into the schedule overlay, never loaded at run time).
TABLE_INPUTS = ("time_embedder.", "norm_out.linear.", "adaln_t_table")

# Threads reading one block file: a deep queue of large sequential reads. On the H200 machines' virtio disk a cold
# 0.83 GB block read at 1.14 / 1.41 / 1.57 / 1.62 GB/s with 1 / 2 / 4 / 8 threads (disk: 1.66 GB/s), where reading
# several block files at once, one thread each, did not pass 1.17 GB/s (benchmarks/results/end_to_end_h200.json).
READ_WORKERS = 8


_FILE_RECORD: tuple[Field, ...] = (("size", "a byte count", is_count), ("sha256", "a hex digest", is_text))
_LORA_RECORD: tuple[Field, ...] = (
    ("linear", "a linear's name", is_text), ("index", "an integer of 0 or more", is_count),
    ("scale", "a number", is_number), ("row_start", "an integer of 0 or more", is_count),
)
_IDENTITY: tuple[Field, ...] = (
    ("compile_id", "a compile id", is_text), ("profile_id", "a profile id", is_text),
    ("profile", "an object", is_object), ("arch", "an architecture tag", is_text),
)
# What `CompiledArtifact` and `ScheduleOverlay` read from their manifests, with what each must be.
ARTIFACT_FIELDS: tuple[Field, ...] = (
    *_IDENTITY,
    ("config", "an object", is_object),
    ("base_weights", "an object", is_object),
    ("blocks", "a list of {file, size, sha256, lora} records", list_of(
        ("file", "", is_file_name), *_FILE_RECORD, ("lora", "", list_of(*_LORA_RECORD)))),
    ("auxiliary.size", "a byte count", is_count),
    ("auxiliary.sha256", "a hex digest", is_text),
)
OVERLAY_FIELDS: tuple[Field, ...] = (
    *_IDENTITY,
    ("num_layers", "a positive integer", is_positive),
    ("entries", "a list of {step, variant, timesteps} records", list_of(
        ("step", "", is_count), ("variant", "", is_count),
        ("timesteps", "", lambda v: isinstance(v, list) and all(map(is_number, v))))),
    ("file.name", "a file name", is_file_name),
    *((f"file.{key}", what, valid) for key, what, valid in _FILE_RECORD),
)


def _read_manifest(path: Path, formats: tuple[str, ...], what: str, fields: tuple[Field, ...]) -> dict:
    manifest = read_json(
        path / "manifest.json", VflashError,
        f"{path}: not a compiled {what} (no manifest.json)", f"{path}/manifest.json: corrupt (not JSON)",
    )
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or found not in formats:
        raise VflashError(f"{path}: {what} format {found!r}, expected {' or '.join(map(repr, formats))}")
    check_fields(manifest, fields, f"{path}/manifest.json", "compile it again")
    return manifest


def _check_size(path: Path, size: int) -> None:
    if not path.is_file():
        raise WeightFileError(f"{path}: missing")
    actual = path.stat().st_size
    if actual != size:
        raise WeightFileError(f"{path}: {actual} bytes, but {size} were recorded when it was compiled")


def _loras(
    records: list[dict], tensors: dict[str, torch.Tensor], prefix: str = ""
) -> dict[str, tuple[LoraResidual, ...]]:
    out: dict[str, list[LoraResidual]] = {}
    for r in records:
        if not r["linear"].startswith(prefix):
            continue
        key = f"lora.{r['linear']}.{r['index']}"
        # a full-rank delta has no up factor, and only a `diff_b` a bias (records without the key have neither)
        parts = ["down", *(["up"] if r.get("up", True) else []), *(["bias"] if r.get("bias", False) else [])]
        if any(f"{key}.{p}" not in tensors for p in parts):
            raise WeightFileError(
                f"the manifest records LoRA factors {key} that the compiled file does not hold; compile it again"
            )
        out.setdefault(r["linear"][len(prefix) :], []).append(LoraResidual(
            tensors[f"{key}.down"], tensors.get(f"{key}.up") if "up" in parts else None, float(r["scale"]),
            int(r["row_start"]), tensors.get(f"{key}.bias") if "bias" in parts else None,
        ))
    return {k: tuple(v) for k, v in out.items()}


@dataclass(frozen=True)
class StepTables:
    """What one evaluation reads from the overlay: timesteps (T,), per-block AdaLN tables (3T, 6H), norm_out
    (T, 2H)."""

    timesteps: torch.Tensor
    blocks: list[torch.Tensor]
    norm_out: torch.Tensor


class ScheduleOverlay:
    """The fixed-schedule tables of one compile."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path, (OVERLAY_FORMAT,), "schedule overlay", OVERLAY_FIELDS)
        _check_size(self.path / self.manifest["file"]["name"], self.manifest["file"]["size"])
        self.store = TensorStore(self.path / self.manifest["file"]["name"])
        self.num_layers = int(self.manifest["num_layers"])
        self.variants: dict[int, list[torch.Tensor]] = {}
        for entry in self.manifest["entries"]:
            self.variants.setdefault(entry["step"], []).append(torch.tensor(entry["timesteps"], dtype=torch.float32))
        sigmas = self.store.read(["video_sigmas", "audio_sigmas"])
        self.video_sigmas, self.audio_sigmas = sigmas["video_sigmas"], sigmas["audio_sigmas"]

    @property
    def nfe(self) -> int:
        return len(self.video_sigmas) - 1

    def find(self, step: int, timesteps: torch.Tensor) -> int:
        """Index of the table variant compiled for exactly this fp32 timestep vector at `step`."""
        for v, vector in enumerate(self.variants.get(step, [])):
            if vector.shape == timesteps.shape and torch.equal(vector, timesteps.cpu()):
                return v
        raise VflashError(
            f"the schedule overlay has no table for timesteps {timesteps.tolist()} at step {step}; this request kind "
            f"was not compiled for profile {self.manifest['profile_id']}"
        )

    def read_step(self, step: int, variant: int) -> StepTables:
        key = f"step{step:03d}.v{variant}"
        names = [f"{key}.timesteps", f"{key}.norm_out"] + [f"{key}.block{i:03d}" for i in range(self.num_layers)]
        data = self.store.read(names)
        return StepTables(data[names[0]], [data[n] for n in names[2:]], data[names[1]])


@dataclass(frozen=True)
class CompiledPaths:
    """Where the three outputs of one compile are (`compile`'s `artifact/`, `schedule/`, `auxiliary.safetensors`), as
    Paths: what a session loads. Each must be a non-empty path, checked when built."""

    artifact: Path
    schedule_overlay: Path
    auxiliary: Path

    def __post_init__(self) -> None:
        for name in ("artifact", "schedule_overlay", "auxiliary"):
            object.__setattr__(self, name, path_argument(getattr(self, name), name))


class CompiledArtifact:
    """One compile: packed blocks, auxiliary tensors and schedule overlay, checked against each other.

    `fp8`: an FP8 artifact (approximate, compiled for an FP8 profile): the four block linears are E4M3 codes with
    FP32 row scales (`<linear>.weight_scale`); all other tensors are the BF16 artifact's."""

    @classmethod
    def at(cls, paths: CompiledPaths) -> CompiledArtifact:
        """The compile whose three outputs are at `paths`."""
        return cls(paths.artifact, paths.schedule_overlay, paths.auxiliary)

    def __init__(self, artifact: str | Path, schedule_overlay: str | Path, auxiliary: str | Path):
        self.artifact_dir = Path(artifact)
        self.manifest = _read_manifest(
            self.artifact_dir, (ARTIFACT_FORMAT, ARTIFACT_FP8_FORMAT), "artifact", ARTIFACT_FIELDS
        )
        self.fp8 = self.manifest["format"] == ARTIFACT_FP8_FORMAT
        self.overlay = ScheduleOverlay(schedule_overlay)
        self.aux_path = Path(auxiliary)
        _check_size(self.aux_path, self.manifest["auxiliary"]["size"])
        self.aux_store = TensorStore(self.aux_path)
        aux_meta = self.aux_store.metadata
        ids = {
            "artifact": self.manifest["compile_id"],
            "schedule overlay": self.overlay.manifest["compile_id"],
            "auxiliary tensors": aux_meta.get("compile_id"),
        }
        if len(set(ids.values())) != 1:
            raise IdentityMismatchError(
                "artifact, schedule overlay and auxiliary tensors come from different compiles: "
                + ", ".join(f"{k} {v}" for k, v in ids.items())
            )
        self.config = H3Config.from_dict(self.manifest["config"])
        for record in self.manifest["blocks"]:
            _check_size(self.artifact_dir / record["file"], record["size"])
        if len(self.manifest["blocks"]) != self.config.num_layers or self.overlay.num_layers != self.config.num_layers:
            raise WeightFileError(
                f"{self.artifact_dir}: block count does not match the config ({self.config.num_layers})"
            )

    def verify(self, workers: int = 8) -> None:
        """Re-hash every file of this compile against the sha256 recorded when it was written; raises
        `WeightFileError` naming each file that differs. Loading checks formats, identities and sizes only, so a
        flipped byte goes unnoticed until this runs (reading the whole model: ~40 GB at full size)."""
        records = [(self.artifact_dir / b["file"], b["sha256"]) for b in self.manifest["blocks"]]
        records += [
            (self.aux_path, self.manifest["auxiliary"]["sha256"]),
            (self.overlay.path / self.overlay.manifest["file"]["name"], self.overlay.manifest["file"]["sha256"]),
        ]
        with ThreadPoolExecutor(workers) as pool:
            actual = list(pool.map(lambda record: file_sha256(record[0]), records))
        bad = [str(path) for (path, expected), found in zip(records, actual) if found != expected]
        if bad:
            raise WeightFileError(
                f"{len(bad)} compiled file(s) differ from what the compiler wrote (corrupt or modified): "
                f"{', '.join(bad)}"
            )

    @property
    def compile_id(self) -> str:
        return self.manifest["compile_id"]

    @property
    def arch(self) -> str:
        return self.manifest["arch"]

    @property
    def profile_id(self) -> str:
        return self.manifest["profile_id"]

    @property
    def profile_record(self) -> dict[str, object]:
        """The profile's identity as compiled (`Profile.identity`), what `check_profile` compares."""
        return self.manifest["profile"]

    @property
    def adapter(self) -> dict[str, object] | None:
        """The adapter's file identity and scale source as compiled (name, size, sha256, format, ...); None without."""
        return self.manifest.get("adapter")

    @property
    def loras(self) -> dict[str, object] | None:
        """The LoRA stack compiled after the adapter (mode, and each file's identity and strength); None without."""
        return self.manifest.get("loras")

    @property
    def block_sizes(self) -> list[int]:
        """Bytes of each main block's file, in block order."""
        return [int(record["size"]) for record in self.manifest["blocks"]]

    @property
    def auxiliary_size(self) -> int:
        """Bytes of the auxiliary tensors' file."""
        return int(self.manifest["auxiliary"]["size"])

    def part_sizes(self) -> PartSizes:
        """The memory plan's sizes of this core: every block, the largest (one ring slot), the auxiliary tensors."""
        blocks = self.block_sizes
        return PartSizes(core_blocks=sum(blocks), core_block=max(blocks), core_auxiliary=self.auxiliary_size)

    def block_file(self, index: int) -> Path:
        """The file of main block `index`."""
        return self.artifact_dir / self.manifest["blocks"][index]["file"]

    def block_lora_linears(self, index: int) -> set[str]:
        """The linears of main block `index` that carry LoRA residuals."""
        return {record["linear"] for record in self.manifest["blocks"][index]["lora"]}

    @property
    def blocks_carry_lora(self) -> bool:
        """Whether any main block carries LoRA residuals."""
        return any(record["lora"] for record in self.manifest["blocks"])

    @property
    def base_weights(self) -> dict[str, object]:
        """The base weights' form (`layout`, `format`: "bf16" / "fp8_scaled" / ..., `pruned`: the curve table's
        grid and rank or None) and file identities, as compiled."""
        return self.manifest["base_weights"]

    def base_weight_notes(self) -> list[str]:
        """How these weights differ from the official BF16 release, one line each (none for the release itself)."""
        base = self.manifest["base_weights"]
        notes = []
        kept = self.fp8 and self.manifest.get("fp8", {}).get("origin") in ("kept", "mixed")
        if base.get("format") == "fp8_scaled":
            notes.append(
                "transformer weights from an fp8_scaled file, "
                f"{'its other float8 weights ' if kept else ''}dequantized to BF16 "
                "(float8 code x per-tensor scale, as ComfyUI core dequantizes them): exact for those weights, "
                "which are not the BF16 release"
            )
        if base.get("dequantized") and base.get("format") != "fp8_scaled":  # int8_convrot, GGUF: how they were read
            notes.append(f"transformer weights: {base['dequantized']}")
        if self.fp8:
            scales = (
                "the fp8_scaled file's own E4M3 codes, its per-tensor scale repeated per output row" if kept
                else "E4M3 codes with one FP32 scale per output row (row absmax / 448)"
            )
            notes.append(
                f"approximate FP8 block linears: {scales}, executed {self.manifest['profile']['fp8']} "
                f"(profile {self.profile_id})"
            )
        if base.get("pruned"):
            notes.append(
                f"a pruned transformer: approximate AdaLN (rank-{base['pruned']['rank']} time embedding read by linear "
                f"interpolation from a {base['pruned']['grid']}-row table, computed as ComfyUI core computes it)"
            )
        if self.manifest.get("adapter_not_applied"):
            notes.append(
                f"{len(self.manifest['adapter_not_applied'])} LoRA module(s) feeding the AdaLN tables not applied: "
                "they do not fit a pruned file's reduced-rank AdaLN (ComfyUI core skips them too)"
            )
        return notes

    def check_profile(self, profile: Profile) -> None:
        """Model, adapter, schedule and hardware identities must agree; names alone never convert assets."""
        check_identity(
            profile, self.manifest["profile"], f"compiled artifact {self.artifact_dir} (profile {self.profile_id})"
        )
        check_identity(
            profile, self.overlay.manifest["profile"],
            f"schedule overlay {self.overlay.path} (profile {self.overlay.manifest['profile_id']})",
        )
        if profile.arch != self.arch:
            raise IdentityMismatchError(
                f"profile {profile.id} is for {profile.arch}; the artifact was compiled on {self.arch}"
            )

    def block_tensors(self) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """Name -> (shape, allowed dtypes) of every packed block's tensors (LoRA factors aside), in file order."""
        specs = {
            k.split(".", 2)[2]: (tuple(v), FLOAT_DTYPES)
            for k, v in block_shapes(self.config, "blocks.0", with_adaln=False).items()
        }
        if self.fp8:
            for linear in FP8_LINEARS:
                shape = specs[f"{linear}.weight"][0]
                specs[f"{linear}.weight"] = (shape, (torch.float8_e4m3fn,))
                specs[f"{linear}.weight_scale"] = ((shape[0], 1), (torch.float32,))
        return specs

    def read_block(self, index: int) -> LayerWeights:
        """One packed block (tensors owning host buffers), its file read by `READ_WORKERS` threads at once."""
        record = self.manifest["blocks"][index]
        path = self.block_file(index)
        specs = self.block_tensors()
        weights = SequentialWeights(path, read_workers=READ_WORKERS)
        weights.require(specs)  # from the header, before anything is read
        with weights:
            data = weights.tensors()
        return LayerWeights({k: data[k] for k in specs}, _loras(record["lora"], data))

    def read_block_loras(self, index: int) -> dict[str, tuple[LoraResidual, ...]]:
        """The LoRA residuals of main block `index` alone (its factors read, nothing else): what stays beside
        weights streamed from the block's file."""
        records = self.manifest["blocks"][index]["lora"]
        if not records:
            return {}
        store = TensorStore(self.block_file(index))
        return _loras(records, store.read([name for name in store.names if name.startswith("lora.")]))

    def iter_blocks(self) -> Iterator[LayerWeights]:
        """Every main block, in order; the next block is read while the consumer copies the last one to its device."""
        count = self.config.num_layers
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(self.read_block, 0) if count else None
            for i in range(count):
                block = pending.result()  # type: ignore[union-attr]
                pending = pool.submit(self.read_block, i + 1) if i + 1 < count else None
                yield block

    def read_auxiliary(
        self,
    ) -> tuple[dict[str, torch.Tensor], list[LayerWeights], dict[str, tuple[LoraResidual, ...]]]:
        """(aux tensors, refiner blocks, aux LoRA residuals) of the runtime; no timestep-only tensors."""
        names = {n: shape for n, shape in aux_shapes(self.config).items() if not n.startswith(TABLE_INPUTS)}
        refiner_shapes = {
            n: shape
            for j in range(self.config.num_refiner_layers)
            for n, shape in block_shapes(self.config, f"refiner.{j}", with_adaln=False).items()
        }
        self.aux_store.require({k: (v, FLOAT_DTYPES) for k, v in {**names, **refiner_shapes}.items()})
        data = self.aux_store.read(self.aux_store.names)
        try:
            records = json.loads(self.aux_store.metadata.get("lora", "[]"))
        except ValueError:
            records = None
        if not list_of(*_LORA_RECORD)(records):
            raise WeightFileError(
                f"{self.aux_path}: its `lora` metadata is not a list of LoRA records; compile it again"
            )
        refiner = []
        for j in range(self.config.num_refiner_layers):
            prefix = f"refiner.{j}."
            tensors = {k[len(prefix) :]: data[k] for k in refiner_shapes if k.startswith(prefix)}
            refiner.append(LayerWeights(tensors, _loras(records, data, prefix)))
        aux_loras = {k: v for k, v in _loras(records, data).items() if not k.startswith("refiner.")}
        return {n: data[n] for n in names}, refiner, aux_loras
