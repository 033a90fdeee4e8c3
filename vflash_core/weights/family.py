"""Small random-weight MiniMax-H3 model families, written in the official on-disk layout of the converted repository.

The embedded demo and the pipeline tests cannot download anything, so they build a complete family here, folder for
folder what `MiniMaxAI/MiniMax-H3` holds and what the pipeline reads from a real model root:

    transformer/ transformer_ref/   diffusers `MiniMaxH3Transformer3DModel` folders
                                    (`synthetic.write_diffusers_transformer`)
    vae/ audio_vae/                 `AutoencoderKLMiniMaxH3` (fp32) / `AutoencoderKLMiniMaxH3Audio` folders
    text_encoder/                   `Qwen3VLForConditionalGeneration` (bf16, >= 51 text layers),
                                    `save_pretrained` layout
    tokenizer/ processor/           a byte-level BPE `Qwen2Tokenizer` trained here on a small text, with the Qwen
                                    vision special tokens; the processor's image and video preprocessor configs
    scheduler/ audio_scheduler/     `MiniMaxH3Scheduler` at shifts 12 and 3
    modular_model_index.json        the diffusers modular index, plus the canvas rules of this family

The weights are random, so what the family generates is noise-like; it exists to exercise the exact code path of the
real model (diffusers loads the same folder with `ModularPipeline.from_pretrained`). Large weights are drawn per
tensor from seeds (`synthetic.random_like`, `synthetic.RandomWeights`) on a chosen device and written shard by shard,
so the same code writes the demo's family and the released model at full size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..engine.config import TEXT_ENCODER_LAYER, H3Config
from . import synthetic

__all__ = ["DEMO_FAMILY", "FamilySpec", "build_model_family"]

# Qwen's multimodal special tokens; their ids are written into the text encoder config.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
END_OF_TEXT = "<|endoftext|>"

# The text the demo tokenizer's merges are learned from: scene vocabulary and the labels of the H3 presentation.
_TOKENIZER_CORPUS = """\
A robot dances in the rain on a neon street at night while drums, bass and a choir play. The camera slowly pans
left across the crowd, then tilts up to the glowing sky. Waves crash on a rocky shore at sunset; seagulls call and
the wind howls. A cat jumps onto a wooden table in a sunny kitchen, knocks over a cup and meows. Close-up of a
guitarist's hands on the strings, warm stage light, applause and cheering. A train crosses a snowy bridge in the
mountains, steam rising, its whistle echoing through the valley. <Picture 1>: <Picture 2>: <Video 1>: <Audio 1>:
<0.2 seconds> <1.2 seconds> <2.2 seconds> 0 1 2 3 4 5 6 7 8 9 10 seconds. Slow motion, wide shot, cinematic.
"""


@dataclass(frozen=True)
class FamilySpec:
    """Sizes of one random-weight family. `transformer` names an `H3Config` preset whose channels match the VAEs."""

    transformer: str
    text: dict[str, Any]  # Qwen3VLTextConfig fields
    vision: dict[str, Any]  # Qwen3VLVisionConfig fields
    video_vae: dict[str, Any]  # AutoencoderKLMiniMaxH3 config
    audio_vae: dict[str, Any]  # AutoencoderKLMiniMaxH3Audio config
    canvas: dict[str, int] = field(default_factory=dict)  # canvas rules recorded in modular_model_index.json
    tokenizer_vocab_size: int = 384
    text_vocab_size: int | None = None  # the text encoder's embedding rows; None: the tokenizer's size
    max_shard_bytes: int | None = None  # large weight files are written in shards of at most this size
    # Write only the text encoder's first N decoder layers and no LM head: what H3 reads (N >= 50), for a machine short
    # of storage. The config still names every layer, so a loader that reads them all (diffusers') cannot load it.
    # None writes the whole encoder, as released.
    text_layers_written: int | None = None


DEMO_FAMILY = FamilySpec(
    transformer="demo",
    text=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=52, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16,
        rope_parameters={
            "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True
        },
    ),
    vision=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=256, deepstack_visual_indexes=[0, 1],
    ),
    video_vae=dict(
        latent_channels=8, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
        decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
        decoder_num_register_tokens=2, decoder_ffn_mult=2,
    ),
    audio_vae=dict(
        encoder_dim=4, encoder_rates=(2, 4, 4, 5, 5), latent_dim=64, latent_channels=8, num_attention_heads=2,
        decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3),), sampling_rate=32000,
    ),
    # The demo generates a small canvas by default; the released model's rules are 768 / 768*1344 / 2048.
    canvas=dict(canvas_short_edge=256, canvas_max_pixels=256 * 448, reference_image_short_edge=128),
)


def _with_latent_stats(config: dict[str, Any], channels: int, seed: int) -> dict[str, Any]:
    # Non-trivial normalisation statistics, so a pipeline that forgets to (de)normalise cannot pass a parity test.
    g = torch.Generator().manual_seed(seed)
    mean = (0.1 * torch.randn(channels, generator=g)).tolist()
    std = (0.8 + 0.4 * torch.rand(channels, generator=g)).tolist()
    return {**config, "latents_mean": mean, "latents_std": std}


def build_tokenizer(folder: Path, vocab_size: int):
    """Train a byte-level BPE on the in-repo corpus with Qwen2's pre-tokenizer; save a `Qwen2Tokenizer` folder."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The same normaliser and pre-tokenizer `Qwen2Tokenizer` installs, so the learned merges fit how it splits text.
    trainer_model = Tokenizer(BPE())
    trainer_model.normalizer = normalizers.NFC()
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    trainer_model.train_from_iterator(_TOKENIZER_CORPUS.splitlines(), trainer)
    model = json.loads(trainer_model.to_str())["model"]
    tokenizer = Qwen2TokenizerFast(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.save_pretrained(folder)
    return tokenizer


def _write_processor(folder: Path, tokenizer, vision: dict[str, Any]) -> None:
    """The `processor/` folder of the official repo: tokenizer files plus image and video preprocessor configs.

    Written from the image processor class itself; the video processor config is written as JSON because the
    transformers video processors need torchvision to be instantiated, and a CPU machine may not have it.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch, merge, temporal = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
    # Bounds wide enough that the processor never resizes a canvas (a multiple of 32) of these families.
    pixels = {"shortest_edge": 32 * 32, "longest_edge": 2048 * 2048}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=temporal, merge_size=merge, size=pixels, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    image_processor.save_pretrained(folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": patch, "temporal_patch_size": temporal, "merge_size": merge, "size": pixels,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": True, "fps": 2,
        "return_metadata": False,
    }
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")
    tokenizer.save_pretrained(folder)


def _write_random_state(
    folder: Path,
    module: torch.nn.Module,
    seed: int,
    dtype: torch.dtype,
    stem: str,
    spec: FamilySpec,
    device: str | torch.device,
    write_workers: int,
    written: Callable[[str], bool] = lambda name: True,
) -> None:
    """Random values (`synthetic.random_like`) for every tensor of `module`'s state that `written` keeps, which may live
    on the meta device: a full-size model is drawn shard by shard on `device` and never instantiated in host memory."""
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items() if written(name)}

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: synthetic.random_like(n, shapes[n], seed, device).to(dtype).cpu() for n in names}

    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    synthetic.write_shards(folder, stem, sizes, produce, spec.max_shard_bytes, write_workers)


def _write_text_encoder(
    folder: Path, spec: FamilySpec, tokenizer, seed: int, device: str | torch.device, write_workers: int
) -> None:
    """`Qwen3VLForConditionalGeneration` in bf16, as released, in the `save_pretrained` layout."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS
        )
    }
    vocab = spec.text_vocab_size or len(tokenizer)
    config = Qwen3VLConfig(
        text_config={**spec.text, "vocab_size": vocab}, vision_config=spec.vision, tie_word_embeddings=False, **ids
    )
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    _write_random_state(
        folder, model, seed, torch.bfloat16, "model", spec, device, write_workers,
        partial(_text_tensor_written, spec.text_layers_written),
    )
    config.save_pretrained(folder)


def _text_tensor_written(layers: int | None, name: str) -> bool:
    """Whether a text encoder tensor is written when only the first `layers` decoder layers are (None: all)."""
    if layers is None:
        return True
    found = re.match(r"model\.language_model\.layers\.(\d+)\.", name)
    return name != "lm_head.weight" and (found is None or int(found.group(1)) < layers)


def _write_vaes(root: Path, spec: FamilySpec, seed: int, device: str | torch.device, write_workers: int) -> None:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    video_config = _with_latent_stats(spec.video_vae, spec.video_vae.get("latent_channels", 24), seed)
    audio_config = _with_latent_stats(spec.audio_vae, spec.audio_vae.get("latent_channels", 32), seed + 1)
    with torch.device("meta"):
        video = AutoencoderKLMiniMaxH3(**video_config)
    _write_random_state(
        root / "vae", video, seed, torch.float32, "diffusion_pytorch_model", spec, device, write_workers
    )
    video.save_config(root / "vae")
    # The audio VAE's anti-aliasing filters are persistent buffers computed by its constructor, so it is built
    # (small: ~150 M parameters) rather than drawn, under a fixed seed without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        audio = AutoencoderKLMiniMaxH3Audio(**audio_config)
    audio.save_pretrained(root / "audio_vae")


def _modular_index(spec: FamilySpec, with_ref: bool) -> dict[str, Any]:
    components = {
        "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
        "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
        "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
        "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
        "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2TokenizerFast"),
        "processor": ("transformers", "Qwen3VLProcessor"),
    }
    if with_ref:
        components["transformer_ref"] = ("diffusers", "MiniMaxH3Transformer3DModel")
    index: dict[str, Any] = {
        "_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": "0.42.1",
        "_blocks_class_name": "MiniMaxH3Blocks",
    }
    for name, (library, cls) in components.items():
        index[name] = [library, cls, {
            "pretrained_model_name_or_path": None, "subfolder": name, "type_hint": [library, cls], "variant": None,
            "revision": None,
        }]
    index.update(spec.canvas)
    return index


#: What `build_model_family` can write; the default is all of it.
PARTS = ("transformer", "transformer_ref", "text", "vaes", "index")


def build_model_family(
    root: str | Path,
    spec: FamilySpec = DEMO_FAMILY,
    seed: int = 0,
    with_ref: bool = True,
    parts: tuple[str, ...] = PARTS,
    device: str | torch.device = "cpu",
    write_workers: int = 1,
) -> Path:
    """Write a random-weight family into `root` (created). Returns `root`.

    `parts` selects what is written (a caller short of disk can write the transformer, compile it, remove it, then
    write the rest); `device` is where the random numbers are drawn (a GPU is much faster at full size, and the
    values depend on it); `write_workers` files are written concurrently.
    """
    from diffusers import MiniMaxH3Scheduler

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown family parts {sorted(unknown)}; known: {PARTS}")
    if (
        spec.text_layers_written is not None
        and not TEXT_ENCODER_LAYER <= spec.text_layers_written <= spec.text["num_hidden_layers"]
    ):
        raise ValueError(
            f"text_layers_written must be {TEXT_ENCODER_LAYER}..{spec.text['num_hidden_layers']} "
            f"(H3 reads layers 0..{TEXT_ENCODER_LAYER - 1}), got {spec.text_layers_written}"
        )
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = H3Config.preset(spec.transformer)
    video_channels, audio_channels = (
        spec.video_vae.get("latent_channels", 24), spec.audio_vae.get("latent_channels", 32)
    )
    if (
        config.in_channels != video_channels or config.audio_in_channels != audio_channels
        or config.text_dim != spec.text["hidden_size"]
    ):
        raise ValueError(f"preset {spec.transformer!r} does not match the family's VAE channels or text width")
    for part, offset in (("transformer", 0), ("transformer_ref", 1)):
        if part in parts and (with_ref or part == "transformer"):
            weights = synthetic.RandomWeights(config, seed=seed + offset, device=device)
            synthetic.write_diffusers_transformer(root / part, config, weights, spec.max_shard_bytes, write_workers)
    if "vaes" in parts:
        _write_vaes(root, spec, seed + 2, device, write_workers)
    if "text" in parts:
        tokenizer = build_tokenizer(root / "tokenizer", spec.tokenizer_vocab_size)
        _write_processor(root / "processor", tokenizer, spec.vision)
        _write_text_encoder(root / "text_encoder", spec, tokenizer, seed + 3, device, write_workers)
    if "index" in parts:
        MiniMaxH3Scheduler(12.0).save_pretrained(root / "scheduler")
        MiniMaxH3Scheduler(3.0).save_pretrained(root / "audio_scheduler")
        (root / "modular_model_index.json").write_text(json.dumps(_modular_index(spec, with_ref), indent=2) + "\n")
    return root
