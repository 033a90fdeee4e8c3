"""Stand-ins for the ComfyUI core nodes the example workflows use, with core's node ids, inputs and outputs
(ComfyUI 0.33.0): `EmptyMiniMaxH3LatentAV`, `CreateVideo`, `SaveVideo`, `LoadImage`, `LoadAudio`, `CLIPLoader`,
`VAELoader`.

`CLIPLoader` and `VAELoader` return objects with the interface of core's `comfy.sd.CLIP` (type minimax) and
`comfy.sd.VAE` (H3 video / audio VAE) that the Vflash nodes call. Core builds them from Comfy-Org's single files;
these stand-ins build them from a small random family's diffusers folders, named by a one-line JSON file in
`text_encoders/` or `vae/` (`{"family_root": ..., "part": "text_encoder" | "video_vae" | "audio_vae"}`). The CLIP
stand-in follows core's `MiniMaxH3Tokenizer` presentation and computes the family's `hidden_states[50]`, so its
conditioning is the diffusers one by construction: tests with it check what the Vflash nodes do with core's objects,
not core's numerics (`tests/test_comfyui_server.py` measures those)."""

from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np
import torch
from PIL import Image, ImageOps

import comfy.nested_tensor
import folder_paths
from comfy_api.latest import InputImpl, Types, io, ui


def _align(n: int) -> int:
    while n % 17 != 5:
        n += 1
    return n


class EmptyMiniMaxH3LatentAV(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="EmptyMiniMaxH3LatentAV",
            display_name="Empty MiniMax H3 AV Latent",
            category="model/latent/minimax",
            inputs=[
                io.Int.Input("width", default=1344, min=32, max=16384, step=32),
                io.Int.Input("height", default=768, min=32, max=16384, step=32),
                io.Int.Input("length", default=124, min=5, max=3600, step=17),
            ],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(cls, width, height, length):
        frames = _align(max(5, length))
        latent_t = 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2
        audio_t = round(frames / 24 * 40)
        video = torch.zeros([1, 24, latent_t, height // 16, width // 16])
        audio = torch.zeros([1, 32, 2, audio_t])
        return io.NodeOutput({"samples": comfy.nested_tensor.NestedTensor((video, audio))})


class CreateVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="CreateVideo",
            display_name="Create Video",
            category="video",
            inputs=[
                io.Image.Input("images"),
                io.Float.Input("fps", default=30.0, min=1.0, max=120.0, step=1.0),
                io.Audio.Input("audio", optional=True),
                io.Int.Input("bit_depth", min=8, max=10, default=8, step=2, optional=True),
            ],
            outputs=[io.Video.Output()],
        )

    @classmethod
    def execute(cls, images, fps, audio=None, bit_depth=8):
        return io.NodeOutput(InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=audio, frame_rate=Fraction(fps)), bit_depth=bit_depth))


class SaveVideo(io.ComfyNode):
    @staticmethod
    def codec_input(codecs, optional=False):
        """Core's `_save_video_codec_input`: codec, and for h264 / av1 an optional `encoding` (auto / re-encode)."""
        encoding = io.DynamicCombo.Input("encoding", display_name="encoding mode", optional=True, options=[
            io.DynamicCombo.Option("auto", []),
            io.DynamicCombo.Option("re-encode", [io.Float.Input("crf", default=23.0, min=0.0, max=51.0, step=1.0),
                                                 io.Combo.Input("color_space", options=["auto", "bt709", "bt601"], default="auto")]),
        ])
        return io.DynamicCombo.Input("codec", optional=optional, options=[io.DynamicCombo.Option(c, [] if c == "auto" else [encoding]) for c in codecs])

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SaveVideo",
            display_name="Save Video",
            category="video",
            inputs=[
                io.Video.Input("video"),
                io.String.Input("filename_prefix", default="video/ComfyUI"),
                io.DynamicCombo.Input("format", options=[io.DynamicCombo.Option(k, [cls.codec_input(["auto", "h264", "av1"])]) for k in ("auto", "mp4", "mkv")]),
                cls.codec_input(["auto", "h264", "av1"], optional=True),  # core's hidden top-level codec (the frontend exports it)
            ],
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo],
            is_output_node=True,
            outputs=[io.Video.Output("video")],
        )

    @classmethod
    def execute(cls, video, filename_prefix, format, codec=None):
        format_name = format["format"] if isinstance(format, dict) else format
        codec = (format.get("codec") if isinstance(format, dict) else None) or codec or "auto"
        codec = codec["codec"] if isinstance(codec, dict) else codec
        width, height = video.get_dimensions()
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, folder_paths.get_output_directory(), width, height)
        file = f"{filename}_{counter:05}_.{Types.VideoContainer.get_extension(format_name)}"
        metadata = {"prompt": cls.hidden.prompt} if cls.hidden is not None and cls.hidden.prompt is not None else None
        video.save_to(os.path.join(folder, file), format=Types.VideoContainer(format_name), codec=Types.VideoCodec(codec), metadata=metadata)
        return io.NodeOutput(video, ui=ui.PreviewVideo([ui.SavedResult(file, subfolder, io.FolderType.output)]))


class LoadImage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        files = sorted(os.listdir(folder_paths.get_input_directory())) if os.path.isdir(folder_paths.get_input_directory()) else []
        return io.Schema(
            node_id="LoadImage",
            display_name="Load Image",
            category="image",
            inputs=[io.Combo.Input("image", options=files, upload=io.UploadType.image)],
            outputs=[io.Image.Output(), io.Mask.Output()],
        )

    @classmethod
    def execute(cls, image):
        img = ImageOps.exif_transpose(Image.open(folder_paths.get_annotated_filepath(image)))
        rgb = torch.from_numpy(np.array(img.convert("RGB")).astype(np.float32) / 255.0)[None]
        mask = torch.zeros((1, rgb.shape[1], rgb.shape[2]), dtype=torch.float32)
        return io.NodeOutput(rgb, mask)


class LoadAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        files = sorted(os.listdir(folder_paths.get_input_directory())) if os.path.isdir(folder_paths.get_input_directory()) else []
        return io.Schema(
            node_id="LoadAudio",
            display_name="Load Audio",
            category="audio",
            inputs=[io.Combo.Input("audio", options=files, upload=io.UploadType.audio)],
            outputs=[io.Audio.Output()],
        )

    @classmethod
    def execute(cls, audio):
        with av.open(folder_paths.get_annotated_filepath(audio)) as container:
            stream = container.streams.audio[0]
            chunks = [frame.to_ndarray() for frame in container.decode(stream)]
            rate = stream.rate
        data = np.concatenate(chunks, axis=1).astype(np.float32)
        return io.NodeOutput({"waveform": torch.from_numpy(data)[None], "sample_rate": int(rate)})


def _family_file(folder: str, name: str) -> dict:
    import json

    return json.loads(open(folder_paths.get_full_path_or_raise(folder, name)).read())


class _StandInCLIP:
    """`comfy.sd.CLIP` for type minimax: `tokenize(text, images=[...], minimax_ref_items=[...])` and
    `encode_from_tokens_scheduled(tokens)` -> `[[cond (1, L, D), {"pooled_output": None, "minimax_token_tags": (L,)}]]`."""

    def __init__(self, conditioner):
        self.conditioner = conditioner
        self.calls = []

    def tokenize(self, text, return_word_ids=False, images=[], minimax_ref_items=None, **kwargs):
        self.calls.append({"text": text, "images": list(images), "minimax_ref_items": minimax_ref_items})
        return {"qwen3vl_32b": [[("stand-in", text, list(images), minimax_ref_items)]]}

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict={}, show_pbar=True):
        _, text, images, items = tokens["qwen3vl_32b"][0][0]
        if items:
            raise NotImplementedError("the stand-in CLIP encodes t2va and keyframe presentations only")
        pictures = [Image.fromarray((img[0].numpy() * 255.0).round().astype(np.uint8)) for img in images]
        out = self.conditioner.encode(text, pictures)
        return [[out.prompt_embeds[None].clone(), {"pooled_output": None, "minimax_token_tags": out.token_tags.clone(), **add_dict}]]


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
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders")),
                io.Combo.Input("type", options=["stable_diffusion", "minimax", "qwen_image"]),
                io.Combo.Input("device", options=["default", "cpu"], optional=True),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip_name, type, device="default"):
        from vflash_core.conditioning import TextConditioner

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
            inputs=[io.Combo.Input("vae_name", options=folder_paths.get_filename_list("vae"))],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae_name):
        from vflash_core.vae import MediaVAEs

        spec = _family_file("vae", vae_name)
        return io.NodeOutput(_StandInVAE(MediaVAEs.from_pretrained(spec["family_root"], "cpu"), spec["part"]))


NODES = [EmptyMiniMaxH3LatentAV, CreateVideo, SaveVideo, LoadImage, LoadAudio, CLIPLoader, VAELoader]
