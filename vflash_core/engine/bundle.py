"""The conditioning bundle: everything request-specific the native core consumes.

A bundle holds the encoded prompt (text rows of the packed sequence), the packed layout, and the initial video and
audio rows (conditioning rows already noised, target rows drawn from the request generator). It is produced by the
pipeline's encoders (or by `build_keyframe_bundle` from precomputed embeddings) and crosses into the core either

* persisted: a folder with `tensors.safetensors` and `manifest.json`, whose sha256 is checked on load, or
* in process: a `BundleHandoff`, validated again when consumed and consumable once.

Noise-draw contract (diffusers' H3 latents steps): one generator; first one draw per visual condition in packed order
(noised to t = 0.999), then the video noise as a `(1, C, F, h, w)` latent, then the audio noise directly in `(2A, C)`
row layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import BundleError, VflashError
from ..fileio import atomic_directory, path_argument, read_json
from ..formats import Field, check_fields, is_count, is_positive
from ..schedule import KEYFRAME_NOISE_AUG, scale_noise
from ..tensor_store import TensorStore, file_sha256
from .config import NUM_MODALITIES, H3Config
from .layout import AUDIO_CHANNELS, Geometry, PackedLayout, ReferenceBlock, keyframe_layout, patchify, ref2va_layout

__all__ = [
    "MODE_VARIANT", "BundleHandoff", "ConditioningBundle", "EncodedReference", "build_keyframe_bundle",
    "build_ref2va_bundle",
]

BUNDLE_FORMAT = "vflash-bundle/1"
MODES = ("t2va", "i2va", "l2va", "fl2va", "ref2va")
# Which transformer partition serves a mode.
MODE_VARIANT = {
    "t2va": "transformer", "i2va": "transformer", "l2va": "transformer", "fl2va": "transformer",
    "ref2va": "transformer_ref"
}
_TENSORS = "tensors.safetensors"
_MANIFEST = "manifest.json"
_INDEX_DTYPES = (torch.int64, torch.int32)
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# The tensors of `tensors.safetensors`, with the dtypes each may have.
_TENSOR_DTYPES = {
    "prompt_embeds": _FLOATS, "video_rows": (torch.float32,), "audio_rows": (torch.float32,), "position_ids": _FLOATS,
    "token_tags": _INDEX_DTYPES, "video_indices": _INDEX_DTYPES, "audio_indices": _INDEX_DTYPES,
    "text_indices": _INDEX_DTYPES,
}
# What `ConditioningBundle.load` reads from a manifest: every field it uses, with what it must be.
_MANIFEST_FIELDS: tuple[Field, ...] = (
    ("mode", f"one of {', '.join(MODES)}", lambda v: v in MODES),
    *((f"geometry.{k}", "a positive integer", is_positive) for k in ("height", "width", "num_frames")),
    *(
        (f"model_layout.{k}", "a positive integer", is_positive)
        for k in ("text_dim", "video_patch_dim", "audio_in_channels")
    ),
    (
        "model_layout.patch_size", "three positive integers",
        lambda v: isinstance(v, list) and len(v) == 3 and all(map(is_positive, v))
    ),
    ("num_condition_video_rows", "an integer of 0 or more", is_count),
    ("num_condition_audio_rows", "an integer of 0 or more", is_count),
    ("seed", "an integer of 0 or more, or null", lambda v: v is None or is_count(v)),
)


@dataclass(frozen=True)
class ModelLayout:
    """The transformer geometry a bundle was built for; a bundle only runs on a model with the same one."""

    text_dim: int
    video_patch_dim: int
    audio_in_channels: int
    patch_size: tuple[int, int, int]

    @classmethod
    def of(cls, config: H3Config) -> ModelLayout:
        patch_t, patch_h, patch_w = config.patch_size
        return cls(config.text_dim, config.video_patch_dim, config.audio_in_channels, (patch_t, patch_h, patch_w))

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "patch_size": list(self.patch_size)}


@dataclass
class ConditioningBundle:
    """Request-side input of the core.

    prompt_embeds: (L, text_dim) in the text encoder's dtype; text rows of the packed sequence.
    video_rows: (Nv, video_patch_dim) fp32, conditioning rows first.
    audio_rows: (Na, audio_in_channels) fp32, reference rows first, channel-major.
    """

    mode: str
    geometry: Geometry
    model_layout: ModelLayout
    prompt_embeds: torch.Tensor
    layout: PackedLayout
    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    seed: int | None = None

    def validate(self) -> None:
        """Internal consistency and index ranges; raises `BundleError` naming the mismatch."""
        lay, m = self.layout, self.model_layout
        if self.mode not in MODES:
            raise BundleError(f"bundle mode {self.mode!r} is not one of {MODES}")
        rows = lay.sequence_length
        for name, tensor, stop in (
            ("text_indices", lay.text_indices, rows), ("video_indices", lay.video_indices, rows),
            ("audio_indices", lay.audio_indices, rows), ("token_tags", lay.token_tags, NUM_MODALITIES),
        ):
            if tensor.ndim != 1 or tensor.dtype not in _INDEX_DTYPES:
                raise BundleError(
                    f"inconsistent conditioning bundle: {name} must be a 1-D integer tensor, "
                    f"got {list(tensor.shape)} {tensor.dtype}"
                )
            if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= stop):
                raise BundleError(
                    f"inconsistent conditioning bundle: {name} holds values "
                    f"{int(tensor.min())}..{int(tensor.max())}, outside 0..{stop - 1}"
                )
        for name, count, total in (
            ("num_condition_video_rows", lay.num_condition_video_rows, lay.video_indices.numel()),
            ("num_condition_audio_rows", lay.num_condition_audio_rows, lay.audio_indices.numel()),
        ):
            if not 0 <= count <= total:
                raise BundleError(
                    f"inconsistent conditioning bundle: {name} {count} is outside 0..{total} (the rows there are)"
                )
        checks = [
            (
                self.prompt_embeds.ndim == 2 and self.prompt_embeds.shape[1] == m.text_dim,
                f"prompt_embeds {list(self.prompt_embeds.shape)} vs text_dim {m.text_dim}"
            ),
            (lay.text_indices.numel() == self.prompt_embeds.shape[0], "text rows vs prompt_embeds length"),
            (
                tuple(self.video_rows.shape) == (lay.video_indices.numel(), m.video_patch_dim),
                (
                    f"video_rows {list(self.video_rows.shape)} vs "
                    f"{lay.video_indices.numel()} video rows of width {m.video_patch_dim}"
                ),
            ),
            (
                tuple(self.audio_rows.shape) == (lay.audio_indices.numel(), m.audio_in_channels),
                (
                    f"audio_rows {list(self.audio_rows.shape)} vs "
                    f"{lay.audio_indices.numel()} audio rows of width {m.audio_in_channels}"
                ),
            ),
            (
                self.video_rows.dtype == torch.float32 and self.audio_rows.dtype == torch.float32,
                "latent rows must be float32"
            ),
            (lay.position_ids.shape == (lay.sequence_length, 3), "position_ids shape"),
            (lay.token_tags.shape == (lay.sequence_length,), "token_tags length"),
            (
                lay.text_indices.numel() + lay.video_indices.numel() + lay.audio_indices.numel() == lay.sequence_length,
                "index tensors do not cover the sequence"
            ),
            (
                lay.video_indices.numel() - lay.num_condition_video_rows
                == self.geometry.num_latent_frames * self.geometry.rows_per_frame(m.patch_size),
                "target video rows vs geometry"
            ),
            (
                lay.audio_indices.numel() - lay.num_condition_audio_rows
                == AUDIO_CHANNELS * self.geometry.num_audio_latents,
                "target audio rows vs geometry"
            ),
        ]
        failed = [what for ok, what in checks if not ok]
        if failed:
            raise BundleError("inconsistent conditioning bundle: " + "; ".join(failed))
        covered = torch.zeros(lay.sequence_length, dtype=torch.bool)
        for idx in (lay.text_indices, lay.video_indices, lay.audio_indices):
            covered[idx] = True
        if not bool(covered.all()):
            raise BundleError("inconsistent conditioning bundle: index tensors overlap or leave rows uncovered")

    def check_model(self, config: H3Config) -> None:
        """Refuse a bundle built for another transformer layout."""
        expected = ModelLayout.of(config)
        if self.model_layout != expected:
            raise BundleError(
                f"bundle was built for model layout {self.model_layout.to_dict()}, this model has {expected.to_dict()}"
            )

    # -- persistence ------------------------------------------------------------------------------------------

    def _tensor_dict(self) -> dict[str, torch.Tensor]:
        return {
            "prompt_embeds": self.prompt_embeds,
            "video_rows": self.video_rows,
            "audio_rows": self.audio_rows,
            **self.layout.tensors(),
        }

    def fingerprint(self) -> str:
        """sha256 over every tensor's name, dtype, shape and bytes."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self._tensor_dict().items()):
            t = tensor.detach().contiguous().cpu()
            digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write the bundle folder atomically; refuses to overwrite."""
        self.validate()
        path = Path(path)
        with atomic_directory(path) as tmp:
            tensors = {k: v.detach().contiguous().cpu() for k, v in self._tensor_dict().items()}
            save_file(tensors, str(tmp / _TENSORS), metadata={"format": BUNDLE_FORMAT})
            manifest = {
                "format": BUNDLE_FORMAT,
                "mode": self.mode,
                "geometry": asdict(self.geometry),  # height, width, num_frames
                "model_layout": self.model_layout.to_dict(),
                "num_condition_video_rows": self.layout.num_condition_video_rows,
                "num_condition_audio_rows": self.layout.num_condition_audio_rows,
                "seed": self.seed,
                "tensors_sha256": file_sha256(tmp / _TENSORS),
            }
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ConditioningBundle:
        """Read a bundle folder, verifying its content hash, its manifest field by field, its tensors' names, dtypes and
        values (finite) and its consistency: a bundle is input, and one whose hash was recomputed is still checked."""
        path = path_argument(path, "the bundle folder")
        manifest = read_json(
            path / _MANIFEST, BundleError, f"{path}: not a conditioning bundle (no {_MANIFEST})",
            f"{path}: corrupt {_MANIFEST}"
        )
        if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise BundleError(f"{path}: bundle format {found!r}, expected {BUNDLE_FORMAT!r}")
        actual = file_sha256(path / _TENSORS) if (path / _TENSORS).is_file() else None
        if actual != manifest.get("tensors_sha256"):
            raise BundleError(
                f"{path}: {_TENSORS} does not match the hash in its manifest (modified after it was written)"
            )
        check_fields(manifest, _MANIFEST_FIELDS, f"{path}/{_MANIFEST}", error=BundleError)
        try:
            tensors = TensorStore(path / _TENSORS)
        except VflashError as exc:
            raise BundleError(f"{path}: {exc}") from None
        missing = sorted(set(_TENSOR_DTYPES) - set(tensors.names))
        if missing:
            raise BundleError(f"{path}: incomplete bundle: {_TENSORS} has no {', '.join(missing)}")
        for name, dtypes in _TENSOR_DTYPES.items():
            if tensors.info(name).dtype not in dtypes:
                raise BundleError(
                    f"{path}: {name} is {tensors.info(name).dtype}, expected {' or '.join(map(str, dtypes))}"
                )
        data = tensors.read(list(_TENSOR_DTYPES))
        for name in ("prompt_embeds", "video_rows", "audio_rows", "position_ids"):
            if not bool(torch.isfinite(data[name]).all()):
                raise BundleError(f"{path}: {name} holds NaN or infinite values; the bundle is corrupt")
        layout = PackedLayout(
            data["position_ids"], data["token_tags"], data["video_indices"], data["audio_indices"],
            data["text_indices"],
            manifest["num_condition_video_rows"], manifest["num_condition_audio_rows"],
        )
        model = manifest["model_layout"]
        bundle = cls(
            mode=manifest["mode"],
            geometry=Geometry(**{k: manifest["geometry"][k] for k in ("height", "width", "num_frames")}),
            model_layout=ModelLayout(
                model["text_dim"], model["video_patch_dim"], model["audio_in_channels"], tuple(model["patch_size"])
            ),
            prompt_embeds=data["prompt_embeds"],
            layout=layout,
            video_rows=data["video_rows"],
            audio_rows=data["audio_rows"],
            seed=manifest.get("seed"),
        )
        bundle.validate()
        return bundle


class BundleHandoff:
    """In-process one-shot transfer of a freshly built bundle from the encoders to the core.

    The bundle is validated and fingerprinted when handed over; `consume()` compares the fingerprint (an unchanged
    bundle is still valid), so a second `consume()` or a bundle modified in between is refused. After consumption the
    handoff holds no tensors.
    """

    def __init__(self, bundle: ConditioningBundle):
        bundle.validate()
        self._bundle: ConditioningBundle | None = bundle
        self._fingerprint = bundle.fingerprint()
        self.mode = bundle.mode
        self.sequence_length = bundle.layout.sequence_length  # packed rows of every evaluation (for memory needs)

    @property
    def consumed(self) -> bool:
        return self._bundle is None

    def consume(self) -> ConditioningBundle:
        if self._bundle is None:
            raise BundleError("this conditioning handoff was already consumed; build a new one per request")
        bundle, self._bundle = self._bundle, None
        if bundle.fingerprint() != self._fingerprint:
            raise BundleError("conditioning bundle was modified after it was handed off")
        return bundle


def build_keyframe_bundle(
    prompt_embeds: torch.Tensor,
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    config: H3Config,
    generator: torch.Generator,
    condition_latents: tuple[torch.Tensor, ...] = (),
    keyframe_anchors: tuple[str, ...] = (),
    seed: int | None = None,
) -> ConditioningBundle:
    """Bundle for t2va (no conditions) or i2va / l2va / fl2va from encoded text and normalised keyframe latents.

    prompt_embeds: (L, text_dim) or (1, L, text_dim). condition_latents: one (1, C, 1, h, w) fp32 latent per keyframe,
    in packed order, matching `keyframe_anchors`.
    """
    if len(condition_latents) != len(keyframe_anchors):
        raise ValueError("one keyframe anchor is needed per condition latent")
    mode = {(): "t2va", ("first",): "i2va", ("last",): "l2va", ("first", "last"): "fl2va"}.get(tuple(keyframe_anchors))
    if mode is None:
        raise ValueError(f"unsupported keyframe anchors {keyframe_anchors}")
    if prompt_embeds.ndim == 3:
        prompt_embeds = prompt_embeds[0]
    layout = keyframe_layout(text_token_tags, geometry, config.patch_size, tuple(keyframe_anchors))
    video_rows, audio_rows = _draw_rows(condition_latents, geometry, config, generator)
    return ConditioningBundle(
        mode, geometry, ModelLayout.of(config), prompt_embeds, layout, video_rows, audio_rows, seed
    )


def _draw_rows(
    condition_latents: tuple[torch.Tensor, ...], geometry: Geometry, config: H3Config, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The video rows (each condition latent noised to `KEYFRAME_NOISE_AUG`, then the target's noise) and the target's
    audio noise rows, drawn from `generator` in that order."""
    condition_rows = []
    for condition in condition_latents:
        noise = torch.randn(condition.shape, generator=generator, dtype=torch.float32)
        condition_rows.append(patchify(scale_noise(condition.float(), KEYFRAME_NOISE_AUG, noise), config.patch_size))
    video_noise = torch.randn(
        (1, config.in_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width),
        generator=generator,
        dtype=torch.float32,
    )
    audio_noise = torch.randn(
        (AUDIO_CHANNELS * geometry.num_audio_latents, config.audio_in_channels), generator=generator,
        dtype=torch.float32
    )
    return torch.cat([*condition_rows, patchify(video_noise, config.patch_size)]), audio_noise


@dataclass(frozen=True)
class EncodedReference:
    """One ref2va reference after the VAEs, in request order.

    video_latents: (1, C, f, h, w) fp32 normalised latents of an image (f = 1) or video reference, else None.
    audio_rows: (2 A_r, C_audio) fp32 normalised channel-major rows of an audio reference or a video's soundtrack.
    """

    kind: str
    video_latents: torch.Tensor | None = None
    audio_rows: torch.Tensor | None = None

    def block(self) -> ReferenceBlock:
        frames, height, width = self.video_latents.shape[2:5] if self.video_latents is not None else (0, 0, 0)
        audio = 0 if self.audio_rows is None else self.audio_rows.shape[0] // AUDIO_CHANNELS
        return ReferenceBlock(self.kind, int(frames), int(height), int(width), int(audio))


def build_ref2va_bundle(
    prompt_embeds: torch.Tensor,
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    config: H3Config,
    generator: torch.Generator,
    references: tuple[EncodedReference, ...],
    seed: int | None = None,
) -> ConditioningBundle:
    """Bundle for ref2va from encoded text and references (see `layout.ref2va_layout` for the packing).

    Draws: one noise per visual reference in request order (held at t = 0.999), then the target video and audio
    noise. Reference soundtracks ride along clean, ahead of the target audio rows.
    """
    if not references:
        raise ValueError("a ref2va bundle needs at least one reference")
    if prompt_embeds.ndim == 3:
        prompt_embeds = prompt_embeds[0]
    layout = ref2va_layout(text_token_tags, geometry, config.patch_size, tuple(r.block() for r in references))
    visual = tuple(r.video_latents for r in references if r.video_latents is not None)
    video_rows, audio_noise = _draw_rows(visual, geometry, config, generator)
    audio_rows = torch.cat([*(r.audio_rows.float() for r in references if r.audio_rows is not None), audio_noise])
    return ConditioningBundle(
        "ref2va", geometry, ModelLayout.of(config), prompt_embeds, layout, video_rows, audio_rows, seed
    )

