"""Stand-ins for the ComfyUI core nodes the example workflows use, with core's node ids, inputs and outputs
(ComfyUI 0.33.0): `EmptyMiniMaxH3LatentAV`, `CreateVideo`, `SaveVideo`, `LoadImage`, `LoadAudio`."""

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
    @classmethod
    def define_schema(cls):
        codec = io.Combo.Input("codec", options=["auto", "h264", "av1"], default="auto")
        return io.Schema(
            node_id="SaveVideo",
            display_name="Save Video",
            category="video",
            inputs=[
                io.Video.Input("video"),
                io.String.Input("filename_prefix", default="video/ComfyUI"),
                io.DynamicCombo.Input("format", options=[io.DynamicCombo.Option(k, [codec]) for k in ("auto", "mp4", "mkv")]),
            ],
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo],
            is_output_node=True,
            outputs=[io.Video.Output("video")],
        )

    @classmethod
    def execute(cls, video, filename_prefix, format):
        format_name = format["format"] if isinstance(format, dict) else format
        codec = format.get("codec", "auto") if isinstance(format, dict) else "auto"
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


NODES = [EmptyMiniMaxH3LatentAV, CreateVideo, SaveVideo, LoadImage, LoadAudio]
