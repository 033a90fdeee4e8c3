"""Custom socket types of the Vflash pack (handles that only Vflash nodes produce and consume), the sockets that
also take core's types, and the words every Vflash node is found by."""

from comfy_api.latest import io

from .engines import present_devices

VflashModel = io.Custom("VFLASH_MODEL")  # DiT engine spec: its files (weights, profile, LoRAs) and run options
VflashTextEncoder = io.Custom("VFLASH_TE")  # Qwen3-VL text/vision conditioner spec
VflashVAE = io.Custom("VFLASH_VAE")  # video + audio VAE pair spec
VflashCond = io.Custom("VFLASH_COND")  # encoded prompt, keyframes / references and the geometry they were encoded for
VflashLora = io.Custom("VFLASH_LORA")  # chain of (LoRA file, strength)

# Node search: every Vflash node is found by these words. They only widen the match: the frontend ranks a display
# name or node id that starts with the query first, shorter ones before longer, so the display names start with
# "MiniMax H3 Vflash" and the node ids with "Vflash" (the sampler and the all-in-one node are the shortest).
SEARCH_ALIASES = ["minimax", "minimax h3", "h3", "video audio", "video + audio", "soundtrack", "vflash"]


def vflash_schema(name: str, title: str, category: str, search: tuple[str, ...], **schema) -> io.Schema:
    """A Vflash node's schema: node id "Vflash<name>", display name "MiniMax H3 Vflash <title>", category
    "Vflash/<category>", found by the pack's search words and `search`; `schema` holds the rest (description, inputs,
    outputs, ...)."""
    return io.Schema(
        node_id=f"Vflash{name}", display_name=f"MiniMax H3 Vflash {title}", category=f"Vflash/{category}",
        search_aliases=[*SEARCH_ALIASES, *search], **schema,
    )


def peer_devices() -> list[str]:
    return ["none", *(d for d in present_devices() if d.startswith("cuda:"))]


DEVICE_TOOLTIP = (
    "'auto' = ComfyUI's compute device, read when the node runs (get_torch_device(); --cpu gives cpu); a model "
    "compiled for a CPU profile (embedded-demo) runs on the CPU. Only the devices this machine has are listed; a "
    "saved cuda:N that it lacks is refused when the graph is queued, never a fallback."
)

TE_TOOLTIP = (
    "The text encoder: Vflash Text Encoder Loader's (diffusers Qwen3-VL folder, bitwise the diffusers conditioning) or "
    "core CLIP from CLIPLoader with type 'minimax' (the Qwen3-VL file in text_encoders/, any format core reads; "
    "ComfyUI manages its memory; not bitwise the diffusers conditioning)."
)
VAE_TOOLTIP = (
    "The VAEs: Vflash VAE Loader's video + audio pair, or core VAE from VAELoader with MiniMax-H3's video VAE file "
    "(vae/); then connect the audio VAE file's VAELoader to audio_vae."
)
AUDIO_VAE_TOOLTIP = (
    "Core VAE from VAELoader with MiniMax-H3's audio VAE file (vae/), beside a core video VAE in vae. Needed to decode "
    "and for reference soundtracks; leave empty with the Vflash VAE Loader."
)


def te_input():
    return io.MultiType.Input("te", types=[VflashTextEncoder, io.Clip], tooltip=TE_TOOLTIP)


def vae_inputs():
    return [
        io.MultiType.Input("vae", types=[VflashVAE, io.Vae], tooltip=VAE_TOOLTIP),
        io.Vae.Input("audio_vae", optional=True, tooltip=AUDIO_VAE_TOOLTIP),
    ]
