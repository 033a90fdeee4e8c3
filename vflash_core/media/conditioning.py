"""Text conditioning with the official Qwen3-VL conditioner, reproducing diffusers 0.42.1.

The presentation is tokenised piece by piece and concatenated, with no chat template, no special tokens, no padding:

* t2va: the prompt;
* keyframes (i2va / l2va / fl2va): per keyframe `"<Picture i>: "` then a vision block
  `<|vision_start|> <|image_pad|> * n <|vision_end|>`, then the prompt;
* ref2va: per reference in request order `"<Audio j>: "` if it carries sound, then `"<Picture i>: "` plus a vision
  block for an image, or `"<Video k>: "` plus one `"<t seconds>"` label and `<|video_pad|>` block per merged frame
  pair for a video; then the prompt.

Vision rows are tagged video (0) for the transformer, text rows 1. One call of the Qwen3-VL base model (the language
model head never runs) returns `hidden_states[50]`: the residual stream after decoder layer 49, before the final norm.
Nothing after layer 49 can influence it, so the conditioner loads only what it needs (`Qwen3VLModel`: embeddings,
the vision tower, decoder layers 0..49): the 14 later layers and the LM head of Qwen3-VL-32B (~15 GB) are never read.
transformers records the final norm's output as the last hidden state, so with 50 layers index 50 would be normed:
the final norm is replaced by the identity, which makes index 50 the residual stream again, bit for bit.

Where the pruned encoder does not fit the device, its decoder layers stream (`stream_layers`): they move once into a
pinned host arena and, during each encode, pass through two device slots of one layer (`residency.ModuleRing`, the
transformer's block-ring mechanism) while the embeddings and the vision tower take the device as a whole part does.
Where the arena does not fit a host-memory budget either, the layers stream from the model root's own safetensors
files (`stream_layers(from_files=True)`, the transformer's disk ring): read again on every encode into a few pinned
staging buffers, the layers holding no weights in between; possible when the conditioner read the files itself and
every layer tensor lies there in the dtype and shape it was loaded in (`decoder_layer_files`).
The model's own forward runs unchanged on the same values, so the streamed encoder equals the resident one bit for
bit. With a memory plan attached, an encode is checked against it before anything moves to the device.

A trusted `text_encoder_loader` (a Python callable) may supply the model instead of `from_pretrained`'s reader: it is
handed the model root and returns a CPU `Qwen3VLModel` or `Qwen3VLForConditionalGeneration` of the architecture in
the root's `text_encoder/config.json`; the conditioner trims it as it loads its own (the base model's layers 0..49,
identity final norm, no LM head), casts it to its dtype, and offloads and releases it like its own.

Image and video pixels go through the official Qwen processors' settings saved in the model's `processor/` folder.
The `Qwen3VLProcessor` wrapper and transformers' video processor need torchvision just to be constructed, so the
conditioner holds the parts (the tokenizer, transformers' image processor, and `QwenVideoProcessor`, Qwen3-VL's video
preprocessing in plain torch) and derives Qwen's per-token modality ids from the model config's image and video token
ids, as that processor does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine.config import TEXT_ENCODER_LAYER, TEXT_TAG, VIDEO_TAG
from ..engine.device_owner import (
    SerialDeviceOwner,
    module_bytes,
    module_tensors,
    point_module_at,
    release_device_memory,
    release_host_memory,
)
from ..engine.layout import FPS
from ..engine.residency import ItemFiles, ModuleRing
from ..errors import RequestError, VflashError
from ..memory_plan import PLANNED_TEXT_ROWS, MemoryNeed, MemoryPlan, PartSizes
from ..tensor_store import TensorStore
from .qwen_video import QwenVideoProcessor
from .references import CanvasRules

if TYPE_CHECKING:
    from transformers import Qwen3VLModel

__all__ = [
    "TEXT_ENCODER_LAYER", "TextConditioner", "TextConditioning", "TextEncoderLoader", "default_dtype", "encode_bytes",
    "sample_video_frames",
]

logger = logging.getLogger(__name__)

VIDEO_SAMPLE_FPS = 2.0  # the rate Qwen reads a reference video at
# A decoder layer's tensor in a Qwen3-VL checkpoint (`model.language_model.layers.3.mlp.up_proj.weight`, with or
# without the leading `model.`): its layer index and its name inside the layer.
_LAYER_KEY = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.(.+)$")
# Qwen's own multimodal token types (not H3's row tags): they drive its 3-D rotary layout.
_QWEN_TEXT, _QWEN_IMAGE, _QWEN_VIDEO = 0, 1, 2
# The config fields a `text_encoder_loader`'s model must share with the model root's `text_encoder/config.json`.
_ARCHITECTURE = {
    "text_config": (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"
    ),
    "vision_config": (
        "hidden_size", "depth", "num_heads", "out_hidden_size", "patch_size", "temporal_patch_size",
        "spatial_merge_size"
    ),
    None: ("image_token_id", "video_token_id"),
}

#: (the prepared model root) -> a CPU `Qwen3VLModel` / `Qwen3VLForConditionalGeneration` of its text encoder.
TextEncoderLoader = Callable[[Path], torch.nn.Module]


@dataclass
class TextConditioning:
    """prompt_embeds: (L, text_dim) in the conditioner's dtype, on the CPU; token_tags: (L,) int64 row tags."""

    prompt_embeds: torch.Tensor
    token_tags: torch.Tensor
    token_ids: list[int]


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (the released weights' precision), fp32 on the CPU (where bf16 matmuls are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sample_video_frames(
    frames: np.ndarray, temporal_patch: int, fps: float = FPS, sample_fps: float = VIDEO_SAMPLE_FPS
) -> tuple[list[np.ndarray], list[float]]:
    """The frames Qwen sees of a 24 fps reference (every 12th, deduplicated) and one timestamp per merged group.

    Groups of `temporal_patch` sampled frames are merged (the last one repeated to fill a group); a group is labelled
    with the mean of its timestamps.
    """
    stride = fps / sample_fps
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < frames.shape[0]:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise RequestError(
            f"a reference video needs at least {minimum} frames at {fps:g} fps ({minimum / fps:.2g} s), "
            f"got {frames.shape[0]}"
        )
    stamps = [i / sample_fps for i in range(len(indices))]
    stamps += [stamps[-1]] * (-len(stamps) % temporal_patch)
    groups = [(stamps[i] + stamps[i + temporal_patch - 1]) / 2 for i in range(0, len(stamps), temporal_patch)]
    return [frames[i] for i in indices], groups


def encode_bytes(text_config, vision_config, tokens: int, patches: int, itemsize: int) -> int:
    """Upper estimate of one text encode's transient device memory: `tokens` presentation tokens, `patches` vision
    patches (before merging), `itemsize` bytes per element of the encoder's dtype.

    Per token: every layer's hidden state, kept for `hidden_states[50]` (layers + 1 rows of the hidden width), the
    residual and normalised streams, and the larger of a layer's MLP (gate, up, SiLU and product: 4 x intermediate)
    and its attention (q, k, v with their normalised and rotated copies and the output). Per patch: the vision
    block's stream and normalised input, the larger of its attention (QKV, output, one more) and its MLP (projection
    and activation), and the merger's four outputs (the final one and the deepstack taps) at the text width, counted
    per patch as an upper bound. A 25 % allowance.
    """
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    q = text_config.num_attention_heads * text_config.head_dim
    kv = text_config.num_key_value_heads * text_config.head_dim
    per_token = (text_config.num_hidden_layers + 1) * hidden + 2 * hidden + max(4 * inter, 4 * q + 6 * kv + hidden)
    width, vision_inter = vision_config.hidden_size, vision_config.intermediate_size
    per_patch = 2 * width + max(5 * width, 2 * vision_inter) + 4 * vision_config.out_hidden_size
    return int((tokens * per_token + patches * per_patch) * itemsize * 1.25)


def _text_encoder_config(root: Path):
    """The `Qwen3VLConfig` of `root`'s `text_encoder/` and its count of text layers, which must exceed H3's layer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root / "text_encoder", local_files_only=True)
    total = config.text_config.num_hidden_layers
    if total <= TEXT_ENCODER_LAYER:
        raise VflashError(f"{root / 'text_encoder'}: {total} text layers; H3 needs more than {TEXT_ENCODER_LAYER}")
    return config, total


def _base_model(text_encoder: torch.nn.Module) -> Qwen3VLModel:
    """The `Qwen3VLModel` of a conditioner: the model itself, or the `.model` of a `Qwen3VLForConditionalGeneration`."""
    return text_encoder.model if hasattr(text_encoder, "lm_head") else text_encoder


def _loaded_text_encoder(loader: TextEncoderLoader, root: Path, config, dtype: torch.dtype) -> torch.nn.Module:
    """The model a `text_encoder_loader` returns for `root`, checked against the root's config and trimmed as
    `TextConditioner.from_pretrained` loads its own: the base model, layers 0..49, identity final norm, in `dtype`."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLModel

    model = loader(root)
    if not isinstance(model, (Qwen3VLModel, Qwen3VLForConditionalGeneration)):
        raise VflashError(
            "text_encoder_loader must return a Qwen3VLModel or Qwen3VLForConditionalGeneration, "
            f"got {type(model).__name__}"
        )
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    if devices != ["cpu"]:
        raise VflashError(
            "text_encoder_loader must return the model on the CPU (the conditioner moves it); "
            f"its tensors are on {', '.join(devices)}"
        )
    differ = []
    for part, fields in _ARCHITECTURE.items():
        mine, theirs = (config, model.config) if part is None else (getattr(config, part), getattr(model.config, part))
        differ += [
            f"{part + '.' if part else ''}{f} {getattr(theirs, f, None)!r} (config.json: {getattr(mine, f, None)!r})"
            for f in fields
            if getattr(theirs, f, None) != getattr(mine, f, None)
        ]
    if differ:
        raise VflashError(
            f"text_encoder_loader returned another architecture than {root / 'text_encoder'}: " + "; ".join(differ)
        )
    base = _base_model(model)
    if len(base.language_model.layers) < TEXT_ENCODER_LAYER:
        raise VflashError(
            f"text_encoder_loader returned {len(base.language_model.layers)} text layers; "
            f"H3 conditions on hidden_states[{TEXT_ENCODER_LAYER}] and needs {TEXT_ENCODER_LAYER}"
        )
    # transformers computes the rotary frequencies in fp32 whatever the weights' dtype (`from_pretrained(dtype=...)`
    # keeps them so), and H3's reference encodes with them; `Module.to(bf16)` rounds them, and the embeddings differ.
    rounded = [
        name for name, buffer in base.named_buffers() if name.endswith("inv_freq") and buffer.dtype != torch.float32
    ]
    if rounded:
        raise VflashError(
            f"text_encoder_loader returned rotary frequencies in {base.get_buffer(rounded[0]).dtype} ({rounded[0]}); "
            "load the model with "
            "from_pretrained(dtype=...) instead of casting it with .to(), which rounds them"
        )
    del base.language_model.layers[TEXT_ENCODER_LAYER:]
    base.language_model.norm = torch.nn.Identity()
    base.config.text_config.num_hidden_layers = base.language_model.config.num_hidden_layers = TEXT_ENCODER_LAYER
    kept = {name: buffer for name, buffer in base.named_buffers() if buffer.dtype == torch.float32}
    base = base.to(dtype)
    point_module_at(base, kept)  # the weights in `dtype`, the fp32 buffers as loaded
    return base


def _around(module: torch.nn.Module, inner: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules of `module` that together hold every parameter and buffer outside `inner`."""
    if module is inner:
        return []
    if not any(m is inner for m in module.modules()):
        return [module]
    if (
        next(module.parameters(recurse=False), None) is not None
        or next(module.buffers(recurse=False), None) is not None
    ):
        raise VflashError(
            f"{type(module).__name__} holds tensors of its own beside the decoder layers; they cannot stream"
        )
    return [m for child in module.children() for m in _around(child, inner)]


def _joined(parts: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """(token ids, row tags) pieces of a presentation, in order, as one list of each."""
    return [i for ids, _ in parts for i in ids], [t for _, tags in parts for t in tags]


class TextConditioner(SerialDeviceOwner):
    """Owns the Qwen3-VL text encoder, its tokenizer and its image/video processors.

    Args:
        text_encoder: `Qwen3VLModel` with layers 0..49 and an identity final norm (what `from_pretrained` loads), or
            a `Qwen3VLModel` / `Qwen3VLForConditionalGeneration` with more than 50 text layers (extra ones are run too).
        tokenizer: the model's `Qwen2TokenizerFast`.
        image_processor: the model's Qwen image processor.
        video_processor: its video preprocessing (`QwenVideoProcessor`); None disables video references.
        device: where `encode` runs; between calls the encoder sits on the CPU (`offload`) unless `keep_on_device`.
            `stream_layers()` streams its decoder layers through the device instead of moving them.
        canvas: the model family's canvas rules (from its `modular_model_index.json`).
        weight_files: the `text_encoder/` folder the weights were read from, as loaded (what `from_pretrained`
            passes); None where they came from elsewhere. Only then can the decoder layers stream from their files.
    """

    def __init__(
        self, text_encoder, tokenizer, image_processor, video_processor=None, device: str | torch.device = "cpu",
        canvas: CanvasRules | None = None, weight_files: Path | None = None,
    ):
        base = _base_model(text_encoder)
        layers = len(base.language_model.layers)
        pruned = isinstance(base.language_model.norm, torch.nn.Identity)
        if layers < TEXT_ENCODER_LAYER or (layers == TEXT_ENCODER_LAYER and not pruned):
            raise VflashError(
                f"H3 conditions on hidden_states[{TEXT_ENCODER_LAYER}] of Qwen3-VL: the text encoder needs more than "
                f"{TEXT_ENCODER_LAYER} text layers, or exactly {TEXT_ENCODER_LAYER} with the final norm removed "
                f"(`TextConditioner.from_pretrained` loads it so); this one has {layers}"
            )
        self.text_encoder = text_encoder.eval()
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.device = torch.device(device)
        self.canvas = canvas or CanvasRules()
        self.weight_files = weight_files
        self.layer_ring: ModuleRing | None = None
        self.memory_plan: MemoryPlan | None = None  # set by `place`: encodes are checked against it
        config = text_encoder.config
        self._ids = {
            name: tokenizer.convert_tokens_to_ids(token)
            for name, token in (
                ("start", "<|vision_start|>"), ("end", "<|vision_end|>"),
                ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
            )
        }
        if (self._ids["image"], self._ids["video"]) != (config.image_token_id, config.video_token_id):
            raise VflashError(
                f"tokenizer vision pads {self._ids['image']}/{self._ids['video']} differ "
                f"from the text encoder's {config.image_token_id}/{config.video_token_id}"
            )

    @classmethod
    def from_pretrained(
        cls, model_root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        text_encoder_loader: TextEncoderLoader | None = None,
    ) -> TextConditioner:
        """Load `text_encoder/` (layers 0..49, no final norm, no LM head), `tokenizer/` and `processor/` of an official
        model root, offline; the text encoder from `text_encoder_loader(root)` instead when given (module docstring)."""
        from transformers import Qwen3VLModel

        root, device = Path(model_root).resolve(), torch.device(device)
        dtype = dtype or default_dtype(device)
        config, total = _text_encoder_config(root)
        if text_encoder_loader is not None:
            logger.info(
                "text encoder: from the caller's loader, trimmed to %d of %d Qwen3-VL text layers in %s",
                TEXT_ENCODER_LAYER, total, dtype
            )
            model = _loaded_text_encoder(text_encoder_loader, root, config, dtype)
            return cls._with_processors(model, root, device, weight_files=None)
        config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER
        logger.info(
            "text encoder: loading %d of %d Qwen3-VL text layers in %s (no final norm, no LM head)",
            TEXT_ENCODER_LAYER, total, dtype
        )
        # Weights of the dropped layers and the LM head stay on disk; transformers reports them as unused, as expected.
        from transformers.utils import logging as hf_logging

        previous, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # its unlabelled "Loading weights" bar: the caller's load stage says it
        try:
            model = Qwen3VLModel.from_pretrained(
                root / "text_encoder", config=config, dtype=dtype, local_files_only=True
            )
            model.language_model.norm = torch.nn.Identity()
        finally:
            hf_logging.set_verbosity(previous)
            if bars:
                hf_logging.enable_progress_bar()
        return cls._with_processors(model, root, device, weight_files=root / "text_encoder")

    @classmethod
    def on_meta_device(
        cls, model_root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> TextConditioner:
        """The conditioner `from_pretrained` loads from `model_root`'s files, its weights on the meta device (no weight
        read): it encodes nothing, and answers the memory plan (`part_sizes`, `encode_need`) as the loaded one will.
        transformers' own construction, in `dtype` (rotary buffers in fp32), as `from_pretrained` before its reads."""
        from transformers import Qwen3VLModel

        root, device = Path(model_root).resolve(), torch.device(device)
        config, _ = _text_encoder_config(root)
        config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER
        with torch.device("meta"):
            model = Qwen3VLModel._from_config(config, dtype=dtype or default_dtype(device))
        model.language_model.norm = torch.nn.Identity()
        return cls._with_processors(model.eval(), root, device, weight_files=root / "text_encoder")

    @classmethod
    def _with_processors(
        cls, model: torch.nn.Module, root: Path, device: torch.device, weight_files: Path | None
    ) -> TextConditioner:
        """A conditioner of `model` with `root`'s tokenizer, processors and canvas rules."""
        from transformers import AutoImageProcessor, Qwen2TokenizerFast

        tokenizer = Qwen2TokenizerFast.from_pretrained(root / "tokenizer", local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(root / "processor", local_files_only=True)
        video_processor = QwenVideoProcessor.from_pretrained(root / "processor")
        return cls(
            model, tokenizer, image_processor, video_processor, device, CanvasRules.from_model_root(root), weight_files
        )

    # -- ownership ----------------------------------------------------------------------------------------------------

    def decoder_layers(self) -> torch.nn.ModuleList:
        return _base_model(self.text_encoder).language_model.layers

    def device_modules(self) -> list[torch.nn.Module]:
        """The whole encoder, or with streamed layers everything but them."""
        if self.layer_ring is None:
            return [self.text_encoder]
        return _around(self.text_encoder, self.decoder_layers())

    def decoder_layer_files(self) -> list[ItemFiles] | None:
        """Where each decoder layer's tensors lie in `weight_files`, by the layer's own names; None where a layer cannot
        be read from them as loaded (no files, a tensor missing, or stored in another dtype or shape)."""
        if self.weight_files is None:
            return None
        store = TensorStore(self.weight_files)  # headers only
        keys = {(int(m.group(1)), m.group(2)): name for name in store.names if (m := _LAYER_KEY.search(name))}
        items: list[ItemFiles] = []
        for index, layer in enumerate(self.decoder_layers()):
            by_file: dict[Path, dict[str, str]] = {}
            for name, tensor in module_tensors(layer).items():
                key = keys.get((index, name))
                if key is None:
                    return None
                info = store.info(key)
                if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
                    return None
                by_file.setdefault(store.file_path(key), {})[key] = name
            items.append(list(by_file.items()))
        return items

    def stream_layers(self, from_files: bool = False) -> None:
        """Stream the decoder layers from now on: their weights move into a pinned host arena (page-locked for a CUDA
        device) and pass through two device slots during each encode. Called before `materialize`, the layers' weights
        are read from their (memory-mapped) files straight into the arena. With `from_files` they stay in their files
        instead and are read on every encode (`decoder_layer_files`, refused where that is None)."""
        if self.layer_ring is not None:
            return
        files = None
        if from_files:
            files = self.decoder_layer_files()
            if files is None:
                raise VflashError(
                    "the text encoder's decoder layers cannot stream from their files: the weights came from a "
                    f"text_encoder_loader, or {self.weight_files} holds them in another dtype or layout than loaded; "
                    "give more host memory (max_host_memory)"
                )
        self.layer_ring = ModuleRing(
            list(self.decoder_layers()), pin=self.device.type == "cuda", what="decoder layer", files=files
        )

    def close(self) -> None:
        """Drop the encoder; the object is unusable afterwards."""
        self.text_encoder = None
        if self.layer_ring is not None:
            self.layer_ring.close()
        self.layer_ring = None
        self._host = None
        release_device_memory(self.device)
        release_host_memory()

    def encode_bytes(self, tokens: int, patches: int) -> int:
        """Transient device bytes of one encode of `tokens` presentation tokens with `patches` vision patches."""
        config = self.text_encoder.config
        return encode_bytes(config.text_config, config.vision_config, tokens, patches, self.text_encoder.dtype.itemsize)

    def part_sizes(self) -> PartSizes:
        """The memory plan's sizes of this encoder: the whole as loaded, its decoder layers (what streams), the largest
        of them (one ring slot), and the layers' bytes that can stream from their files (0: none can)."""
        layers = [module_bytes(layer) for layer in self.decoder_layers()]
        on_disk = sum(layers) if self.decoder_layer_files() is not None else 0
        return PartSizes(
            encoder=module_bytes(self.text_encoder), encoder_layers=sum(layers), encoder_layer=max(layers),
            encoder_layers_on_disk=on_disk,
        )

    def _placement(self) -> str:
        """Where the encoder is now, as a plan places it (on the CPU it stays where it runs)."""
        if self.device.type == "cpu" or self.keep_on_device:
            return "resident"
        return "offload" if self.layer_ring is None else "stream"

    def resident_bytes(self) -> int:
        """The bytes the encoder holds on its device between requests (none where it waits in host memory)."""
        return self.part_sizes().encoder if self._placement() == "resident" else 0

    def encode_need(self, height: int, width: int, pictures: int) -> MemoryNeed:
        """What an encode needs on the device: the weights it brings there and the transient of the memory plan's
        planned text rows (`memory_plan.PLANNED_TEXT_ROWS`) with `pictures` pictures' vision patches at `height` x
        `width` (a reference clip shows the encoder two pictures)."""
        processor = self.image_processor
        patches = pictures * (height // processor.patch_size) * (width // processor.patch_size)
        transient = self.encode_bytes(PLANNED_TEXT_ROWS + patches // processor.merge_size**2, patches)
        return MemoryNeed(self.device, self.part_sizes().encoder_brought(self._placement()), transient)

    def place(self, plan: MemoryPlan) -> None:
        """Take the plan's placement of the encoder (before the weights are read: see `materialize`); each encode is
        checked against the plan from now on."""
        self.keep_on_device = plan.placement.encoder == "resident"
        if plan.placement.encoder in ("stream", "disk-stream"):
            self.stream_layers(from_files=plan.placement.encoder == "disk-stream")
        self.memory_plan = plan

    # -- presentation -------------------------------------------------------------------------------------------------

    def _text(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, [TEXT_TAG] * len(ids)

    def _vision(self, pad: str, count: int) -> tuple[list[int], list[int]]:
        ids = [self._ids["start"]] + [self._ids[pad]] * count + [self._ids["end"]]
        return ids, [VIDEO_TAG] * len(ids)

    def _image_features(self, images: list) -> tuple[dict[str, torch.Tensor], list[int]]:
        if not images:
            return {}, []
        features = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size**2
        vision = {"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"]}
        return vision, [int(g.prod()) // merge for g in features["image_grid_thw"]]

    def keyframe_presentation(
        self, prompt: str, keyframes: list
    ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        """Token ids, row tags and vision inputs for t2va (no keyframes) or keyframe requests (canvas-sized images)."""
        vision, counts = self._image_features(keyframes)
        parts = [
            part
            for index, count in enumerate(counts)
            for part in (self._text(f"<Picture {index + 1}>: "), self._vision("image", count))
        ]
        return *_joined(parts + [self._text(prompt)]), vision

    def reference_presentation(
        self, prompt: str, references: list
    ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        """The ref2va presentation of normalised references (diffusers `MiniMaxH3*Reference`s), in request order."""
        vision, image_counts = self._image_features([r.image for r in references if r.kind == "image"])
        videos = [r for r in references if r.kind == "video"]
        video_counts: list[int] = []
        video_stamps: list[list[float]] = []
        if videos:
            if self.video_processor is None:
                raise RequestError("this text conditioner has no video processor: video references are unavailable")
            sampled = [sample_video_frames(r.frames, self.video_processor.temporal_patch_size) for r in videos]
            video_stamps = [stamps for _, stamps in sampled]
            features = self.video_processor([np.stack(f) for f, _ in sampled])
            vision.update(
                pixel_values_videos=features["pixel_values_videos"], video_grid_thw=features["video_grid_thw"]
            )
            merge = self.video_processor.merge_size**2
            for grid, stamps in zip(features["video_grid_thw"], video_stamps):
                if int(grid[0]) != len(stamps):
                    raise VflashError(
                        f"Qwen merged a reference video into {int(grid[0])} blocks; H3 labels {len(stamps)}"
                    )
                video_counts.append(int(grid[1]) * int(grid[2]) // merge)
        parts: list[tuple[list[int], list[int]]] = []
        seen = {"image": 0, "video": 0, "audio": 0}
        for ref in references:
            if ref.has_audio:
                seen["audio"] += 1
                parts.append(self._text(f"<Audio {seen['audio']}>: "))
            if ref.kind == "image":
                seen["image"] += 1
                parts.append(self._text(f"<Picture {seen['image']}>: "))
                parts.append(self._vision("image", image_counts[seen["image"] - 1]))
            elif ref.kind == "video":
                seen["video"] += 1
                parts.append(self._text(f"<Video {seen['video']}>: "))
                # `:.1f` rounds half to even: the first pair reads "<0.2 seconds>".
                for stamp in video_stamps[seen["video"] - 1]:
                    parts.append(self._text(f"<{stamp:.1f} seconds>"))
                    parts.append(self._vision("video", video_counts[seen["video"] - 1]))
        return *_joined(parts + [self._text(prompt)]), vision

    # -- encoding -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_tokens(self, token_ids: list[int], vision: dict[str, torch.Tensor]) -> torch.Tensor:
        """One conditioner call -> (L, hidden) `hidden_states[50]` in the encoder's dtype, on the CPU."""
        if self.text_encoder is None:
            raise VflashError("this text conditioner was closed")
        model = self.text_encoder
        device = model.get_input_embeddings().weight.device
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        qwen_types = torch.full_like(input_ids, _QWEN_TEXT)
        qwen_types[input_ids == self._ids["image"]] = _QWEN_IMAGE
        qwen_types[input_ids == self._ids["video"]] = _QWEN_VIDEO
        inputs = {k: v.to(device, model.dtype) if k.startswith("pixel_") else v.to(device) for k, v in vision.items()}
        if self.layer_ring is not None:
            self.layer_ring.attach(device)
        try:
            out = _base_model(model)(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=qwen_types,
                use_cache=False, output_hidden_states=True, **inputs,
            )
            return out.hidden_states[TEXT_ENCODER_LAYER][0].to("cpu")
        finally:
            if self.layer_ring is not None:
                self.layer_ring.detach()

    def encode(self, prompt: str, keyframes: list | None = None, references: list | None = None) -> TextConditioning:
        """Encode a request's presentation; `keyframes` are canvas-sized PIL images, `references` normalised ones."""
        if references:
            ids, tags, vision = self.reference_presentation(prompt, references)
        else:
            ids, tags, vision = self.keyframe_presentation(prompt, list(keyframes or []))
        if self.memory_plan is not None:
            patches = sum(v.shape[0] for k, v in vision.items() if k.startswith("pixel_"))
            self.memory_plan.check(
                {"encode": self.encode_bytes(len(ids), patches)},
                f"this request's text encode ({len(ids)} tokens, {patches} vision patches)",
                "Use a shorter prompt or fewer, smaller references.",
            )
        with self.on_device():
            embeds = self.encode_tokens(ids, vision)
        return TextConditioning(embeds, torch.tensor(tags, dtype=torch.long), ids)
