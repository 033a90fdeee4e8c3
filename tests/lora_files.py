"""LoRA files of the tiny model in the original (kohya) layout, and the same file loaded by diffusers + peft: the
reference the LoRA tests hold the parsed factors and scales to."""

from __future__ import annotations

import torch
from conftest import TINY, assert_bitwise, diffusers_transformer

H, INNER, F, TEMB = TINY.hidden_size, TINY.inner_dim, TINY.ffn_dim, TINY.time_embed_dim
# original module -> (out, in)
ORIGINAL_MODULES = {"attn.qkv_proj": (3 * INNER, H), "attn.out_proj": (H, INNER), "mlp.fc1": (2 * F, H), "mlp.fc2": (H, F), "adaln_proj.linear": (18 * H, TEMB)}
# internal linear -> diffusers modules (in row order)
DIFFUSERS_OF = {"attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"], "attn.out": ["attn.to_out.0"], "ffn.in": ["ff.net.0.proj"], "ffn.out": ["ff.net.2"], "adaln": ["adaln_proj.linear"]}


def original_lora(seed: int, ranks: dict[str, int], alpha_tensors: dict[str, float] | None = None, down_name="lora_down", up_name="lora_up", prefix="diffusion_model.", dtype=torch.bfloat16, final_layer: bool = True):
    g = torch.Generator().manual_seed(seed)
    state = {}
    modules = {f"blocks.{i}.{m}": shape for i in range(TINY.num_layers) for m, shape in ORIGINAL_MODULES.items()}
    modules.update({f"token_refiner.blocks.0.{m}": s for m, s in ORIGINAL_MODULES.items() if m != "adaln_proj.linear"})
    if final_layer:
        modules["final_layer.adaln_proj.linear"] = (2 * H, TEMB)
    for name, (out_f, in_f) in modules.items():
        r = ranks.get(name.rsplit(".", 1)[-1] if "adaln" not in name else "adaln", ranks["default"])
        state[f"{prefix}{name}.{down_name}.weight"] = (torch.randn(r, in_f, generator=g) * 0.4).to(dtype)
        state[f"{prefix}{name}.{up_name}.weight"] = (torch.randn(out_f, r, generator=g) * 0.4).to(dtype)
        if alpha_tensors is not None:
            state[f"{prefix}{name}.alpha"] = torch.tensor(alpha_tensors.get(name, 2.0))
    return state


def peft_loaded(folder, lora_path, strength: float = 1.0):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    transformer = diffusers_transformer(folder)
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(12.0), audio_scheduler=MiniMaxH3Scheduler(3.0))
    pipe.load_lora_weights(str(lora_path), adapter_name="a")
    if strength != 1.0:
        pipe.set_adapters(["a"], [strength])
    return transformer


def _peft_module(transformer, internal: str):
    parts = internal.split(".")
    if parts[0] == "blocks":
        root, local = transformer.transformer_blocks[int(parts[1])], ".".join(parts[2:])
    elif parts[0] == "refiner":
        root, local = transformer.token_refiner.refiner_blocks[int(parts[1])], ".".join(parts[2:])
    else:
        return [transformer.get_submodule(internal)]
    return [root.get_submodule(m) for m in DIFFUSERS_OF[local]]


def assert_same_factors_as_peft(adapter, transformer):
    """Every residual's factors and scale equal what peft holds for the corresponding diffusers modules."""
    for internal, residuals in adapter.residuals.items():
        modules = _peft_module(transformer, internal)
        assert len(modules) == len(residuals), internal
        for residual, module in zip(residuals, modules):
            assert_bitwise(residual.down, module.lora_A["a"].weight.data, f"{internal} down")
            assert_bitwise(residual.up, module.lora_B["a"].weight.data, f"{internal} up")
            assert residual.scale == module.scaling["a"], f"{internal}: scale {residual.scale} vs peft {module.scaling['a']}"
