"""Custom socket types of the Vflash pack (handles that only Vflash nodes produce and consume)."""

from comfy_api.latest import io

VflashModel = io.Custom("VFLASH_MODEL")  # DiT engine spec: weights, profile, devices, residency, attention, LoRAs
VflashTextEncoder = io.Custom("VFLASH_TE")  # Qwen3-VL text/vision conditioner spec
VflashVAE = io.Custom("VFLASH_VAE")  # video + audio VAE pair spec
VflashCond = io.Custom("VFLASH_COND")  # encoded prompt, keyframes / references and the geometry they were encoded for
VflashLora = io.Custom("VFLASH_LORA")  # chain of (LoRA file, strength)

DEVICES = ["auto", "cpu", *(f"cuda:{i}" for i in range(8))]
DEVICE_TOOLTIP = (
    "'auto' = ComfyUI's compute device, read when the node runs (get_torch_device(); --cpu gives cpu); a model compiled "
    "for a CPU profile (embedded-demo) runs on the CPU. A cuda:N that does not exist here is an error, never a fallback."
)
