"""Encode, sample, decode and the all-in-one generate node: widget conversion, one `actions` call, wrapping."""

from __future__ import annotations

from comfy_api.latest import io

from . import actions
from .engines import UNLOAD_TARGETS
from .graph_checks import check_graph
from .host import FOLDERS, HOST
from .registry import ENGINES
from .request_inputs import RenderInputs, RequestWidgets
from .types import VflashCond, VflashModel, te_input, vae_inputs, vflash_schema

_WIDTH_TOOLTIP = (
    "Canvas width in pixels: a multiple of 32, aspect ratio within 1:4..4:1 (768x1344 area cap for the released model)."
)
_HEIGHT_TOOLTIP = "Canvas height in pixels: a multiple of 32, aspect ratio within 1:4..4:1."
_LENGTH_TOOLTIP = (
    "Frames at 24 fps, snapped UP to the video VAE's 17 n + 5 grid (124 = 5.17 s); the profile bounds the duration "
    "(5-15 s for the base profiles, ~5 s for turbo ones). The actual count is returned as 'frames'."
)
_SECONDS_TOOLTIP = "When > 0, overrides length: seconds * 24 frames, snapped up to 17 n + 5 (must land in 5-15 s)."
_SEED_TOOLTIP = (
    "Seed of the one CPU generator that draws the keyframe noise, then the video noise, then the audio noise."
)


def _request_inputs():
    """The text encoder, VAEs, prompt and canvas of a request (VflashEncode, VflashGenerate)."""
    return [
        te_input(),
        *vae_inputs(),
        io.String.Input(
            "prompt", multiline=True, dynamic_prompts=True, tooltip="What happens and what it sounds like."
        ),
        io.Int.Input("width", default=1344, min=32, max=4096, step=32, tooltip=_WIDTH_TOOLTIP),
        io.Int.Input("height", default=768, min=32, max=4096, step=32, tooltip=_HEIGHT_TOOLTIP),
        io.Int.Input("length", default=124, min=5, max=3600, step=17, tooltip=_LENGTH_TOOLTIP),
        io.Float.Input("seconds", default=0.0, min=0.0, max=60.0, step=0.1, tooltip=_SECONDS_TOOLTIP),
    ]


# The ref2va reference slots of VflashEncode: (group, slot name, slot type, most slots, tooltip). A slot is named
# `<slot name>_<index>` (`request_inputs.connected_slots` reads them back).
_REFERENCE_SLOTS = (
    ("ref_images", "ref_image", io.Image, 9, "Reference image <Picture i> (ref2va profiles)."),
    ("ref_videos", "ref_video", io.Image, 3, "Reference clip <Video k>: frames at 24 fps, cut to 17 n + 5 frames."),
    ("ref_video_audios", "ref_video_audio", io.Audio, 3,
     ("Soundtrack of the reference clip in the same slot (ref_video_audio_k belongs to ref_video_k); any rate, mono "
      "or stereo.")),
    ("ref_audios", "ref_audio", io.Audio, 3, "Reference audio <Audio j>, resampled to 32 kHz stereo."),
)


def _reference_inputs() -> list:
    """The Autogrow inputs of `_REFERENCE_SLOTS`, each optional, from 0 slots."""
    return [
        io.Autogrow.Input(
            group, optional=True,
            template=io.Autogrow.TemplatePrefix(
                input=kind.Input(slot, tooltip=tooltip), prefix=f"{slot}_", min=0, max=most
            ),
        )
        for group, slot, kind, most, tooltip in _REFERENCE_SLOTS
    ]



class VflashEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Encode", "Prompt / Frames / References", "conditioning",
            search=(
                "encode", "prompt", "text to video", "image to video", "reference to video", "t2va", "i2va", "fl2va",
                "ref2va",
            ),
            description=(
                "Encodes a request: t2va (prompt only), i2va / l2va / fl2va (first and/or last frame), or ref2va "
                "(reference images, videos, audio; refer to them in the prompt as <Picture i>, <Video k>, <Audio j>). "
                "Keyframes and references cannot be mixed. Also returns the empty AV latent of the canvas. te takes "
                "the Vflash text encoder or core CLIP (CLIPLoader type minimax); vae the Vflash VAE pair or core VAEs "
                "(video in vae, audio in audio_vae). With core's text encoder the conditioning is not bitwise the "
                "diffusers pipeline's hidden_states[50] (core's own Qwen3-VL code rounds differently; the sampler "
                "logs this and records it in its latent as vflash_notes); with core's VAEs keyframe / reference "
                "latents are the posterior mean, not the pipeline's seeded sample."
            ),
            inputs=[
                *_request_inputs(),
                io.Image.Input("first_frame", optional=True, tooltip="Keyframe at frame 0 (stretched to the canvas)."),
                io.Image.Input(
                    "last_frame", optional=True, tooltip="Keyframe at the last frame (aspect-preserving cover crop)."
                ),
                *_reference_inputs(),
                io.Boolean.Input(
                    "force_offload", default=True,
                    tooltip="Release the Vflash text encoder after encoding (it is reloaded when the prompt "
                    "changes). Core CLIP stays ComfyUI's to manage.",
                ),
            ],
            outputs=[
                VflashCond.Output(
                    "cond",
                    tooltip="The encoded request (prompt, keyframe / reference latents, canvas); connect it to the "
                    "Vflash Sampler.",
                ),
                io.Latent.Output(
                    "latent", tooltip="Empty H3 AV latent of the canvas (the layout of core's EmptyMiniMaxH3LatentAV)."
                ),
                io.Int.Output("frames", tooltip="The actual frame count after snapping."),
            ],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def execute(
        cls, te, vae, prompt, width, height, length, seconds, first_frame=None, last_frame=None,
        ref_images=None, ref_videos=None, ref_video_audios=None, ref_audios=None, force_offload=True, audio_vae=None,
    ):
        check_graph(getattr(cls.hidden, "prompt", None), HOST, FOLDERS)  # the loaders' widgets, profile vs this request
        cond, latent, frames = actions.encode(
            ENGINES, HOST, te, vae, prompt, width, height, length, seconds, first_frame, last_frame,
            ref_images, ref_videos, ref_audios, force_offload, ref_video_audios, audio_vae,
        )
        return io.NodeOutput(cond, latent, frames)


class VflashSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Sampler", "Sampler", "sampling",
            search=("sampler", "ksampler", "denoise", "generate video"),
            description=(
                "Runs the profile's fixed schedule (its number of evaluations and its video/audio shifts are compiled "
                "into the weights; change the profile to change them). One progress step per evaluation; Cancel stops "
                "within one evaluation and leaves the engine reusable."
            ),
            inputs=[
                VflashModel.Input("model", tooltip="The transformer from the MiniMax H3 Vflash Model Loader."),
                VflashCond.Input(
                    "cond",
                    tooltip="The encoded request from MiniMax H3 Vflash Prompt / Frames / References; its mode "
                    "(t2va, i2va, ref2va ...) must be one the profile accepts.",
                ),
                io.Latent.Input(
                    "latent",
                    tooltip="An EMPTY H3 AV latent (from Vflash Encode or core EmptyMiniMaxH3LatentAV); only its "
                    "canvas and length are used. Keyframe / reference conditionings must match the canvas they were "
                    "encoded for.",
                ),
                io.Int.Input(
                    "seed", default=0, min=0, max=2**63 - 1, control_after_generate=True, tooltip=_SEED_TOOLTIP
                ),
                io.Boolean.Input(
                    "force_offload", default=False,
                    tooltip="Release the transformer's device memory after sampling (the next run reloads it).",
                ),
                io.Boolean.Input(
                    "profile_denoise", default=False,
                    tooltip="Time every stage of every evaluation and print the summary (adds a little overhead).",
                ),
            ],
            outputs=[io.Latent.Output(
                "latent", tooltip="Denoised H3 AV latent in core's layout (core VAEDecode / VAEDecodeAudio accept it)."
            )],
        )

    @classmethod
    def execute(cls, model, cond, latent, seed, force_offload=False, profile_denoise=False):
        latent, _ = actions.sample(ENGINES, HOST, model, cond, latent, seed, force_offload, profile_denoise)
        return io.NodeOutput(latent)


class VflashDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Decode", "Decode (video + audio)", "decode",
            search=("decode", "vae decode", "latent to video"),
            description=(
                "Decodes an H3 AV latent to frames (IMAGE batch), 32 kHz stereo AUDIO and a VIDEO at 24 fps (save it "
                "with core SaveVideo). vae takes the Vflash VAE pair, or core's video VAE with core's audio VAE in "
                "audio_vae."
            ),
            inputs=[
                *vae_inputs(),
                io.Latent.Input(
                    "latent",
                    tooltip="H3 AV latent (Vflash Sampler output or any core H3 AV latent of this model family).",
                ),
            ],
            outputs=[
                io.Image.Output("images", tooltip="The frames as an IMAGE batch (F, H, W, 3), 0..1."),
                io.Audio.Output("audio", tooltip="The soundtrack: 32 kHz stereo, cut to the video's length."),
                io.Video.Output("video", tooltip="Frames + soundtrack at 24 fps; save it with core Save Video."),
            ],
        )

    @classmethod
    def execute(cls, vae, latent, audio_vae=None):
        return io.NodeOutput(*actions.decode(ENGINES, HOST, vae, latent, audio_vae))


class VflashGenerate(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Generate", "Generate", "sampling",
            search=("all in one", "text to video", "image to video", "generate video"),
            description=(
                "All in one: encode, sample with the profile's fixed schedule, decode. t2va, or i2va / l2va / fl2va "
                "with keyframes. te / vae take Vflash's loaders or core's CLIP (type minimax) and VAEs, as Vflash "
                "Encode does."
            ),
            inputs=[
                VflashModel.Input("model", tooltip="The transformer from the MiniMax H3 Vflash Model Loader."),
                *_request_inputs(),
                io.Int.Input(
                    "seed", default=0, min=0, max=2**63 - 1, control_after_generate=True, tooltip=_SEED_TOOLTIP
                ),
                io.Image.Input("first_frame", optional=True, tooltip="Keyframe at frame 0."),
                io.Image.Input("last_frame", optional=True, tooltip="Keyframe at the last frame."),
                io.Boolean.Input(
                    "force_offload", default=False, tooltip="Release the transformer's device memory after sampling."
                ),
            ],
            outputs=[
                io.Video.Output("video", tooltip="Frames + soundtrack at 24 fps; save it with core Save Video."),
                io.Image.Output("images", tooltip="The frames as an IMAGE batch (F, H, W, 3), 0..1."),
                io.Audio.Output("audio", tooltip="The soundtrack: 32 kHz stereo, cut to the video's length."),
            ],
        )

    @classmethod
    def execute(
        cls, model, te, vae, prompt, width, height, length, seconds, seed, first_frame=None, last_frame=None,
        force_offload=False, audio_vae=None,
    ):
        request = RequestWidgets(prompt, width, height, length, seconds, first_frame, last_frame)
        render = RenderInputs(model, te, vae, request, seed, audio_vae)
        return io.NodeOutput(*actions.generate(ENGINES, HOST, render, force_offload))


class VflashCompare(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Compare", "Compare (exact vs fast mode)", "sampling",
            search=("compare", "fast mode", "quality", "psnr", "ssim", "sparse attention", "step cache"),
            description=(
                "Renders one request exactly and with the model loader's fast_mode on the one loaded engine, then "
                "measures what the mode changed: per-frame PSNR and SSIM of the video, the log-spectral distance of "
                "the soundtracks, and each side's time. Only this, on the real weights, speaks to a fast mode's "
                "quality (the demo's random weights prove speed, never quality)."
            ),
            inputs=[
                VflashModel.Input(
                    "model", tooltip="The transformer from the MiniMax H3 Vflash Model Loader, with a fast_mode."
                ),
                *_request_inputs(),
                io.Int.Input(
                    "seed", default=0, min=0, max=2**63 - 1, control_after_generate=True, tooltip=_SEED_TOOLTIP
                ),
                io.Image.Input("first_frame", optional=True, tooltip="Keyframe at frame 0."),
                io.Image.Input("last_frame", optional=True, tooltip="Keyframe at the last frame."),
            ],
            outputs=[
                io.Video.Output(
                    "side_by_side",
                    tooltip="Exact on the left, the fast mode on the right, with the exact side's soundtrack, at 24 "
                    "fps; save it with core Save Video.",
                ),
                io.String.Output(
                    "report", tooltip="A summary table, then the report as JSON (per-frame metrics, times, what the "
                    "fast mode did)."
                ),
            ],
        )

    @classmethod
    def execute(
        cls, model, te, vae, prompt, width, height, length, seconds, seed, first_frame=None, last_frame=None,
        audio_vae=None,
    ):
        request = RequestWidgets(prompt, width, height, length, seconds, first_frame, last_frame)
        return io.NodeOutput(*actions.compare(ENGINES, HOST, RenderInputs(model, te, vae, request, seed, audio_vae)))


class VflashUnload(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "Unload", "Unload (free memory)", "utils",
            search=("unload", "free memory"),
            description=(
                "Releases Vflash engines (device and pinned host memory) when its input arrives; passes the input "
                "through."
            ),
            inputs=[
                io.AnyType.Input(
                    "anything", tooltip="Any value; connect it to order the unload after the node that produces it."
                ),
                io.Combo.Input(
                    "what", options=list(UNLOAD_TARGETS), default="all",
                    tooltip="all, or only the transformer (dit), text encoder (te) or VAEs (vae).",
                ),
            ],
            outputs=[io.AnyType.Output("anything", tooltip="The input, passed through after the unload.")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def execute(cls, anything, what):
        return io.NodeOutput(actions.unload(ENGINES, HOST, anything, what))


NODES = [VflashEncode, VflashSampler, VflashDecode, VflashGenerate, VflashCompare, VflashUnload]
