"""The ComfyUI core nodes the example workflows use, for the headless host: `EmptyMiniMaxH3LatentAV`, `CreateVideo`,
`SaveVideo`, `LoadImage`, `LoadAudio`, with core's node ids, input names and outputs (ComfyUI 0.33.0), written
against the same `comfy_api.latest` and `folder_paths` interfaces as core's, so they are loaded only once those names
resolve to the headless modules.

SaveVideo writes what `vflash_core.media.mp4.write_mp4` writes (mp4, h264 + AAC, whole frame rates, atomically and never
over an existing file), with the prompt in the file's metadata as core saves it, and refuses other containers, codecs
and encodings: `validate_inputs` refuses what it can before anything runs.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import folder_paths
from comfy.nested_tensor import NestedTensor
from comfy_api.latest import InputImpl, Types, io

from vflash_core.errors import VflashError
from vflash_core.fileio import MissingInputError, check_file_name

from .. import comfy_latent as cl


def _input_files() -> list[str]:
    directory = folder_paths.get_input_directory()
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _input_file(name: Any, kind: str) -> bool | str:
    """`validate_inputs` of the file loaders: the name is a file inside the input folder that reads as `kind` (its
    headers, as the pipeline probes its inputs: a text file named .png must not fail once the models are loaded);
    None: linked, checked later."""
    from vflash_core.media.references import probe_media

    if name is None:
        return True
    try:
        probe_media(folder_paths.get_annotated_filepath(name), f"{kind} file {name!r}:", kind)
    except MissingInputError as exc:
        return f"{exc} (set --input-dir)"
    except VflashError as exc:
        return str(exc)
    return True


class EmptyMiniMaxH3LatentAV(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="EmptyMiniMaxH3LatentAV", display_name="Empty MiniMax H3 AV Latent",
            category="model/latent/minimax",
            inputs=[io.Int.Input("width", default=1344, min=32, max=16384, step=32),
                    io.Int.Input("height", default=768, min=32, max=16384, step=32),
                    io.Int.Input("length", default=124, min=5, max=3600, step=17)],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(cls, width: int, height: int, length: int) -> io.NodeOutput:
        latents = cl.empty_latents(cl.core_length_geometry(width, height, length))
        return io.NodeOutput(cl.to_comfy_latent(latents.video, latents.audio, NestedTensor))


class CreateVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CreateVideo", display_name="Create Video", category="video",
            inputs=[io.Image.Input("images"), io.Float.Input("fps", default=30.0, min=1.0, max=120.0, step=1.0),
                    io.Audio.Input("audio", optional=True),
                    io.Int.Input("bit_depth", min=8, max=10, default=8, step=2, optional=True)],
            outputs=[io.Video.Output()],
        )

    @classmethod
    def execute(cls, images, fps: float, audio: dict | None = None, bit_depth: int = 8) -> io.NodeOutput:
        if bit_depth != 8:
            raise VflashError(f"CreateVideo: the headless runner writes 8-bit video, got bit_depth {bit_depth}")
        return io.NodeOutput(
            InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=audio, frame_rate=Fraction(fps)))
        )


def _codec_input(optional: bool = False) -> io.DynamicCombo.Input:
    """Core's codec choice: auto, or h264 / av1 with an optional encoding mode (auto / re-encode)."""
    encoding = io.DynamicCombo.Input("encoding", optional=True, options=[
        io.DynamicCombo.Option("auto", []),
        io.DynamicCombo.Option("re-encode", [
            io.Float.Input("crf", default=23.0, min=0.0, max=51.0, step=1.0),
            io.Combo.Input("color_space", options=["auto", "bt709", "bt601"], default="auto"),
        ]),
    ])
    return io.DynamicCombo.Input("codec", optional=optional, options=[
        io.DynamicCombo.Option(c, [] if c == "auto" else [encoding]) for c in ("auto", "h264", "av1")
    ])


def _choice(value: Any, key: str) -> tuple[Any, dict]:
    """A DynamicCombo's (choice, child values): ComfyUI passes ``{key: choice, <child>: ...}``, a plain value when it
    has no children."""
    return (value.get(key, "auto"), value) if isinstance(value, dict) else (value, {})


def _format_refusal(format: Any, codec: Any) -> str | None:
    """Why the headless runner cannot write this format (the nested values of the format combo, or core's hidden
    top-level codec), or None: it writes mp4 / h264 with its own encoding."""
    container, children = _choice(format, "format")
    name, children = _choice(children.get("codec") or codec or "auto", "codec")
    encoding, _ = _choice(children.get("encoding", "auto"), "encoding")
    if container not in ("auto", "mp4") or name not in ("auto", "h264") or encoding != "auto":
        return (
            "the headless runner writes mp4/h264 with its own encoding "
            f"(got format {container!r}, codec {name!r}, encoding {encoding!r})"
        )
    return None


class SaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SaveVideo", display_name="Save Video", category="video",
            inputs=[io.Video.Input("video"), io.String.Input("filename_prefix", default="video/ComfyUI"),
                    io.DynamicCombo.Input("format", options=[
                        io.DynamicCombo.Option(k, [_codec_input()]) for k in ("auto", "mp4", "mkv")
                    ]),
                    _codec_input(optional=True)],  # core's hidden top-level codec, which the frontend exports
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo], is_output_node=True, outputs=[io.Video.Output("video")],
        )

    @classmethod
    def validate_inputs(cls, filename_prefix: Any = None, format: Any = "auto", codec: Any = None) -> bool | str:
        output = folder_paths.get_output_directory()
        if filename_prefix is not None and (not isinstance(filename_prefix, str) or not filename_prefix.strip()):
            return f"filename_prefix must be a non-empty string, got {json.dumps(filename_prefix)}"
        if filename_prefix is not None and "\x00" in filename_prefix:
            return "filename_prefix must not contain a NUL character"
        if (
            filename_prefix is not None
            and Path(output).resolve() not in (Path(output) / filename_prefix).resolve().parents
        ):
            return f"filename_prefix {filename_prefix!r} points outside the output folder {output}"
        if filename_prefix is not None:  # every folder it names, and the file `execute` writes, fit the names' limit
            *folders, stem = Path(filename_prefix).parts
            try:
                for part in folders:
                    check_file_name(Path(output), part, "filename_prefix folder")
                check_file_name(Path(output), f"{stem}_00001_.mp4", "filename_prefix file name")
            except VflashError as exc:
                return str(exc)
        return _format_refusal(format, codec) or True

    @classmethod
    def execute(cls, video, filename_prefix: str, format: Any, codec: Any = None) -> io.NodeOutput:
        refusal = _format_refusal(format, codec)
        if refusal:
            raise VflashError(f"SaveVideo: {refusal}")
        components = video.get_components()
        if components.audio is None:
            raise VflashError("SaveVideo: the headless runner writes video with its soundtrack; the VIDEO has no audio")
        if components.frame_rate != int(components.frame_rate):
            raise VflashError(
                f"SaveVideo: the headless runner writes whole frame rates, got {float(components.frame_rate)}"
            )
        width, height = video.get_dimensions()
        folder, stem, counter, _, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height
        )
        metadata = {"prompt": cls.hidden.prompt} if cls.hidden.prompt is not None else {}
        video.save_to(
            os.path.join(folder, f"{stem}_{counter:05}_.mp4"), metadata={**metadata, **(cls.hidden.extra_pnginfo or {})}
        )
        return io.NodeOutput(video)


class LoadImage(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(node_id="LoadImage", display_name="Load Image", category="image",
                         inputs=[io.Combo.Input("image", options=_input_files(), upload=io.UploadType.image)],
                         outputs=[io.Image.Output(), io.Mask.Output()])

    @classmethod
    def validate_inputs(cls, image: Any = None) -> bool | str:
        return _input_file(image, "image")

    @classmethod
    def execute(cls, image: str) -> io.NodeOutput:
        import numpy as np
        import torch
        from PIL import Image, ImageOps

        with Image.open(folder_paths.get_annotated_filepath(image)) as img:
            rgb = torch.from_numpy(
                np.asarray(ImageOps.exif_transpose(img).convert("RGB"), dtype=np.float32) / 255.0
            )[None]
        return io.NodeOutput(rgb, torch.zeros(rgb.shape[:3]))


class LoadAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(node_id="LoadAudio", display_name="Load Audio", category="audio",
                         inputs=[io.Combo.Input("audio", options=_input_files(), upload=io.UploadType.audio)],
                         outputs=[io.Audio.Output()])

    @classmethod
    def validate_inputs(cls, audio: Any = None) -> bool | str:
        return _input_file(audio, "audio")

    @classmethod
    def execute(cls, audio: str) -> io.NodeOutput:
        """AUDIO (1, channels, samples) float32 at the file's rate, mono or stereo."""
        import av
        import numpy as np
        import torch

        with av.open(folder_paths.get_annotated_filepath(audio)) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(
                format="fltp", layout="stereo" if stream.channels > 1 else "mono", rate=stream.rate
            )
            chunks = [f.to_ndarray() for frame in container.decode(stream) for f in resampler.resample(frame)]
            rate = stream.rate
        return io.NodeOutput({
            "waveform": torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))[None],
            "sample_rate": int(rate),
        })


NODES: list[type[io.ComfyNode]] = [EmptyMiniMaxH3LatentAV, CreateVideo, SaveVideo, LoadImage, LoadAudio]
