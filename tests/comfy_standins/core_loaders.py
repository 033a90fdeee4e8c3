"""Test-only stand-ins for ComfyUI's core `CLIPLoader` and `VAELoader` (ComfyUI 0.33.0 node ids, inputs, outputs),
which the headless runner does not have.

They return objects with the interface of core's `comfy.sd.CLIP` (type minimax) and `comfy.sd.VAE` (H3 video / audio
VAE) that the Vflash nodes call. Core builds them from Comfy-Org's single files; these build them from a small random
family's diffusers folders, named by a one-line JSON file in `text_encoders/` or `vae/` (`{"family_root": ...,
"part": "text_encoder" | "video_vae" | "audio_vae"}`). The CLIP follows core's `MiniMaxH3Tokenizer` presentation and
computes the family's `hidden_states[50]`, so its conditioning is the diffusers one by construction: tests with it
check what the Vflash nodes do with core's objects, not core's numerics (`tests/test_comfyui_server.py` measures
those)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import torch
from PIL import Image
from vflash_nodes.headless import comfy_io as io


def _family_file(folder: str, name: str) -> dict:
    folder_paths = importlib.import_module("folder_paths")  # the install's own
    return json.loads(open(folder_paths.get_full_path_or_raise(folder, name)).read())


class _StandInCLIP:
    """`comfy.sd.CLIP` for type minimax: `tokenize(text, images=[...], minimax_ref_items=[...])` and
    `encode_from_tokens_scheduled(tokens)` -> `[[cond (1, L, D), {"pooled_output": None, "minimax_token_tags": (L,)}]]`."""

    def __init__(self, conditioner):
        self.conditioner = conditioner
        self.calls = []

    def tokenize(self, text, return_word_ids=False, images=(), minimax_ref_items=None, **kwargs):
        self.calls.append({"text": text, "images": list(images), "minimax_ref_items": minimax_ref_items})
        return {"qwen3vl_32b": [[("stand-in", text, list(images), minimax_ref_items)]]}

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict=None, show_pbar=True):
        _, text, images, items = tokens["qwen3vl_32b"][0][0]
        if items:
            raise NotImplementedError("the stand-in CLIP encodes t2va and keyframe presentations only")
        pictures = [Image.fromarray((img[0].numpy() * 255.0).round().astype(np.uint8)) for img in images]
        out = self.conditioner.encode(text, pictures)
        return [[out.prompt_embeds[None].clone(), {"pooled_output": None, "minimax_token_tags": out.token_tags.clone(), **(add_dict or {})}]]


class _FirstStage(torch.nn.Module):
    """The attributes of core's H3 VAE modules that give their latent channels (video: the post-quant conv's input;
    audio: the latents_mean buffer)."""

    def __init__(self, latent_channels: int, video: bool):
        super().__init__()
        if video:
            self.post_quant_conv = torch.nn.Conv3d(latent_channels, 1, 1)
        else:
            self.register_buffer("latents_mean", torch.zeros(latent_channels))


class _StandInVAE:
    """`comfy.sd.VAE` for H3: video (`latent_dim` 3: encode IMAGE (F, H, W, 3) -> (1, C, f, h, w), decode -> (1, F,
    H, W, 3)) or audio (`latent_dim` 2: encode (B, L, 2) -> (B, C, 2, T), decode -> (B, L, 2)); normalised latents."""

    def __init__(self, vaes, part: str):
        self.vaes = vaes
        self.latent_dim = 3 if part == "video_vae" else 2
        self.latent_channels = 24 if part == "video_vae" else 32  # what core records, whatever the family's size
        self.audio_sample_rate = vaes.sample_rate
        video = part == "video_vae"
        self.first_stage_model = _FirstStage(vaes.latent_channels if video else vaes.audio_latent_channels, video)

    def encode(self, pixels):
        if self.latent_dim == 3:
            return self.vaes.encode_pixels((pixels * 255.0).round().clamp(0, 255).to(torch.uint8).numpy())
        rows = self.vaes.encode_soundtrack(pixels[0].movedim(-1, 0))  # (2 A, C)
        return rows.reshape(2, -1, rows.shape[-1]).permute(2, 0, 1)[None]

    def decode(self, latent):
        if self.latent_dim == 3:
            return self.vaes.decode_video(latent)[None]
        audio = latent[0].permute(1, 0, 2)  # (2, C, A)
        return self.vaes.decode_audio(audio).movedim(0, -1)[None]


class CLIPLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="CLIPLoader",
            display_name="Load CLIP",
            category="advanced/loaders",
            inputs=[
                io.Combo.Input("clip_name", options=importlib.import_module("folder_paths").get_filename_list("text_encoders")),
                io.Combo.Input("type", options=["stable_diffusion", "minimax", "qwen_image"]),
                io.Combo.Input("device", options=["default", "cpu"], optional=True),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip_name, type, device="default"):
        from vflash_core.media.conditioning import TextConditioner

        spec = _family_file("text_encoders", clip_name)
        if type != "minimax":
            raise ValueError(f"the stand-in CLIPLoader loads type minimax only, got {type}")
        return io.NodeOutput(_StandInCLIP(TextConditioner.from_pretrained(spec["family_root"], "cpu")))


class VAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="VAELoader",
            display_name="Load VAE",
            category="loaders",
            inputs=[io.Combo.Input("vae_name", options=importlib.import_module("folder_paths").get_filename_list("vae"))],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae_name):
        from vflash_core.media.vae import MediaVAEs

        spec = _family_file("vae", vae_name)
        return io.NodeOutput(_StandInVAE(MediaVAEs.from_pretrained(spec["family_root"], "cpu"), spec["part"]))


NODES = [CLIPLoader, VAELoader]
