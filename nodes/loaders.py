"""Loader nodes: thin wrappers that turn widget values into engine specs through `actions`."""

from __future__ import annotations

from comfy_api.latest import io

from vflash_core.engine.fast_mode import FAST_MODES
from vflash_core.engine.session_options import STRATEGIES, WEIGHT_RESIDENCIES
from vflash_core.weights.lora import LORA_MODES

from . import actions
from .engines import present_devices, runnable_backends, runnable_profiles, transformer_spec
from .graph_checks import check_graph, refusal, validate_device
from .host import FOLDERS, HOST
from .model_files import (
    COMPONENT_FOLDERS,
    check_model_option,
    component_options,
    lora_options,
    lora_path,
    model_identity,
    model_options,
    path_identity,
)
from .registry import ENGINES
from .types import DEVICE_TOOLTIP, VflashLora, VflashModel, VflashTextEncoder, VflashVAE, peer_devices, vflash_schema

_MODEL_TOOLTIP = (
    "What to run. 'embedded-demo' is a tiny random-weight H3 family built on first use (CPU, for testing graphs). "
    "'vflash/...' are compiled artifacts or prepared-assets receipts in models/vflash; 'diffusers/...' are official "
    "diffusers-layout H3 folders, and the .safetensors and .gguf names are single-file H3 transformers in "
    "models/diffusion_models or models/unet, named as core's Load Diffusion Model names them: both are prepared and "
    "compiled for the profile on first use (progress bar), then cached next to them. Comfy-Org files: bf16 as is; "
    "fp8_scaled dequantized to BF16 at compile time (exact for those weights); *_pruned_* (adaln_t_table) only with a "
    "-pruned profile (approximate AdaLN); int8_convrot dequantized to BF16 at compile time (exact for those weights; "
    "core's own int8 GEMMs are approximate); .gguf files in models/unet or models/diffusion_models (needs the gguf "
    "package) dequantized as ComfyUI-GGUF does; nvfp4, mxfp8 and other quantized formats are refused."
)


# exact, each mode alone, then both (`FastMode.parse` takes the names joined by "+").
_FAST_MODE_OPTIONS = ["exact", *FAST_MODES, "+".join(FAST_MODES)]


class VflashModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "ModelLoader", "Model Loader", "loaders",
            search=("load transformer", "dit", "unet loader"),
            description=(
                "Loads the MiniMax-H3 diffusion transformer into a Vflash engine (compiled, exact fixed-schedule "
                "runtime). The profile, devices and model option are checked when the graph is queued: a profile for "
                "another GPU architecture or a device this machine lacks is refused before any model work."
            ),
            inputs=[
                io.Combo.Input("model", options=model_options(FOLDERS), tooltip=_MODEL_TOOLTIP),
                io.Combo.Input(
                    "profile", options=runnable_profiles(), default="auto",
                    tooltip="The fixed schedule, LoRA binding and GPU architecture the weights are compiled for (the "
                    "id ends in it: -sm90 = H100/H200, -cpu). Only the profiles this machine can run are listed. "
                    "'auto' takes the profile recorded in a compiled artifact or receipt; official weights need an "
                    "explicit one. The profile fixes evaluations, shifts, modes and clip durations (see the "
                    "sampler's tooltip). -pruned profiles (approximate) are for pruned files only.",
                ),
                io.Combo.Input(
                    "weight_residency", options=list(WEIGHT_RESIDENCIES), default="auto",
                    tooltip="Where the transformer blocks live. resident: all on the device. block-ring: in pinned "
                    "host memory, streamed through two device slots (for GPUs that cannot hold the model). "
                    "disk-ring: read from their compiled files on every pass into a few pinned buffers, for machines "
                    "whose RAM cannot hold them (one GPU; as fast as block-ring where the GPU's compute hides the "
                    "reads). auto: resident if it fits (within the card less ComfyUI's --reserve-vram), else "
                    "block-ring, or disk-ring where max_host_memory asks for it. Bits are identical either way.",
                ),
                io.Combo.Input("device", options=present_devices(), default="auto", tooltip=DEVICE_TOOLTIP),
                io.Combo.Input(
                    "peer_device", options=peer_devices(), default="none",
                    tooltip="Optional second GPU of the same host that shares each evaluation (see strategy). "
                    "'none': one device.",
                ),
                io.Combo.Input(
                    "strategy", options=list(STRATEGIES), default=STRATEGIES[0],
                    tooltip="How two GPUs split the work: sequence-head (attention heads / sequence split, one "
                    "all-to-all per block) or tensor (weights split, one all-reduce per block). Ignored with "
                    "peer_device 'none'.",
                ),
                io.Combo.Input(
                    "attention_backend", options=runnable_backends(), default="auto",
                    tooltip="Attention kernel, pinned per call (ComfyUI's own SDPA priority is not inherited). An "
                    "unavailable explicit choice is an error; auto picks the exact default for the device.",
                ),
                io.Float.Input(
                    "max_host_memory", default=0.0, min=0.0, max=4096.0, step=1.0, optional=True,
                    tooltip="GiB of host memory (RAM) the transformer's weights may hold, with a 4 GiB margin for the "
                    "process; 0: no budget. Where the blocks' pinned copy (~37 GiB at full size) does not fit, they "
                    "stream from their compiled files (disk-ring, ~2.2 GiB). A budget nothing fits is refused with the "
                    "numbers.",
                ),
                VflashLora.Input(
                    "lora", optional=True,
                    tooltip="LoRA chain from Vflash LoRA Select (any number, each at its strength), compiled with the "
                    "weights; a Turbo profile's own LoRA comes first, at the profile's strength.",
                ),
                io.Combo.Input(
                    "lora_mode", options=list(LORA_MODES), default="residual", optional=True,
                    tooltip="How the LoRA chain runs, both exact: residual keeps each LoRA as a separate low-rank "
                    "residual (as diffusers with peft adapters; a small cost per LoRA per step); merged adds them into "
                    "the weights when compiling (as diffusers' fuse_lora; no per-step cost). Changing it recompiles.",
                ),
                io.Combo.Input(
                    "fast_mode", options=_FAST_MODE_OPTIONS, default="exact", optional=True,
                    tooltip="exact (default) keeps the reference's bits. The others are approximate, named and "
                    "measured: sparse-attention (block-sparse attention in the middle layers), step-cache (evaluations "
                    "whose first block barely moved reuse the other blocks' residual), or both; results report what "
                    "they did. Only MiniMax H3 Vflash Compare on the real weights says what a mode costs in quality.",
                ),
            ],
            outputs=[VflashModel.Output(
                "model", tooltip="The transformer engine (a spec; the engine loads on first use and after an unload)."
            )],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, model):
        """Runs when the graph is queued. ComfyUI files a refusal once per argument of this method, so it takes the
        model option alone (one error naming the folder a missing file belongs in); the other widgets are checked
        against their lists by ComfyUI, and across each other by the first Vflash node that runs
        (`graph_checks.check_graph`)."""
        return refusal(check_model_option, FOLDERS, model)

    @classmethod
    def fingerprint_inputs(cls, model, **kwargs):
        return (model, model_identity(FOLDERS, model), tuple(sorted(kwargs.items())))

    @classmethod
    def execute(cls, model, profile, lora=None, lora_mode="residual", **engine_widgets):
        # the loaders' widgets, profile vs the graph's requests
        check_graph(getattr(cls.hidden, "prompt", None), HOST, FOLDERS)
        spec = transformer_spec(HOST, FOLDERS, model, profile, engine_widgets, lora, lora_mode)
        return io.NodeOutput(actions.load_model(ENGINES, HOST, spec))


class VflashLoraSelect(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return vflash_schema(
            "LoraSelect", "LoRA Select", "loaders",
            search=("lora", "turbo lora"),
            description="Adds one LoRA file to a chain for the Vflash Model Loader.",
            inputs=[
                io.Combo.Input(
                    "lora", options=lora_options(FOLDERS),
                    tooltip="A LoRA in models/loras: diffusers/peft, original (LightX2V, ai-toolkit, kohya, musubi), "
                    "DiffSynth, ComfyUI's saved LoRAs, or a full-rank diff / diff_b delta (LoKr / LoHa are refused).",
                ),
                io.Float.Input(
                    "strength", default=1.0, min=-4.0, max=4.0, step=0.01,
                    tooltip="Scale of this LoRA (strength * alpha / rank per module; a full-rank delta: strength). "
                    "The chain is compiled with the weights; changing a strength recompiles.",
                ),
                VflashLora.Input("prev", optional=True, tooltip="Earlier LoRAs of the chain."),
            ],
            outputs=[VflashLora.Output(
                "lora", tooltip="The chain so far; connect it to the model loader or to the next LoRA Select."
            )],
        )

    @classmethod
    def fingerprint_inputs(cls, lora, strength, **kwargs):
        return (lora, strength, path_identity(lora_path(FOLDERS, lora)))

    @classmethod
    def execute(cls, lora, strength, prev=None):
        return io.NodeOutput(actions.select_lora(FOLDERS, lora, strength, prev))


class _ComponentLoader(io.ComfyNode):
    """The text encoder and VAE pair loaders: one model-root option (input `OPTION`) and a device, loaded now."""

    KIND = ""  # "te" or "vae"
    OPTION = ""

    @classmethod
    def component_schema(
        cls, name: str, title: str, search: tuple[str, ...], description: str, option_tooltip: str, output: io.Output,
    ) -> io.Schema:
        return vflash_schema(
            name, title, "loaders", search=search, description=description,
            inputs=[
                io.Combo.Input(cls.OPTION, options=component_options(FOLDERS, cls.KIND), tooltip=option_tooltip),
                io.Combo.Input("device", options=present_devices(), default="auto", tooltip=DEVICE_TOOLTIP),
            ],
            outputs=[output],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, device):
        return validate_device(HOST, device)

    @classmethod
    def fingerprint_inputs(cls, device, **option):
        source = option[cls.OPTION]
        return (source, device, model_identity(FOLDERS, source, COMPONENT_FOLDERS[cls.KIND]))

    @classmethod
    def execute(cls, device, **option):
        check_graph(getattr(cls.hidden, "prompt", None), HOST, FOLDERS)
        return io.NodeOutput(actions.load_component(ENGINES, HOST, FOLDERS, cls.KIND, option[cls.OPTION], device))


class VflashTextEncoderLoader(_ComponentLoader):
    KIND, OPTION = "te", "encoder"

    @classmethod
    def define_schema(cls):
        return cls.component_schema(
            "TextEncoderLoader", "Text Encoder Loader", ("qwen3-vl", "text encoder", "clip"),
            "Loads MiniMax-H3's Qwen3-VL conditioner (text encoder, tokenizer and processor of a diffusers model "
            "folder), bitwise the diffusers conditioning. For the single file in text_encoders/ use core CLIPLoader "
            "(type minimax) instead: Vflash Encode takes its CLIP.",
            "A model folder with text_encoder/, tokenizer/ and processor/ (official layout), or 'embedded-demo'.",
            VflashTextEncoder.Output("te", tooltip="The text encoder (a spec; it loads on first use)."),
        )


class VflashVAELoader(_ComponentLoader):
    KIND, OPTION = "vae", "vae"

    @classmethod
    def define_schema(cls):
        return cls.component_schema(
            "VAELoader", "VAE Loader (video + audio)", ("vae", "audio vae"),
            "Loads MiniMax-H3's video VAE and audio VAE (32 kHz stereo) of a diffusers model folder as one pair. For "
            "the files in vae/ use two core VAELoaders instead: Vflash Encode / Decode take them (vae + audio_vae).",
            "A model folder with vae/ and audio_vae/ (official layout), or 'embedded-demo'.",
            VflashVAE.Output("vae", tooltip="The video + audio VAE pair (a spec; it loads on first use)."),
        )


NODES = [VflashModelLoader, VflashLoraSelect, VflashTextEncoderLoader, VflashVAELoader]
