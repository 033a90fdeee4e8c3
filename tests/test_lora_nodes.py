"""The LoRA chain in the node pack over its headless host: any number of Vflash LoRA Select nodes, each at its
strength, into the Model Loader with its lora_mode, compiled for the profile on first use (one compile per stack),
to an MP4; core's LoRA loaders refused in one line naming the node to use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from headless_nodes import API, output_dir, run
from safetensors.torch import save_file
from vflash_nodes.workflow import WorkflowError, headless_node_types, load_api_workflow, plan

from vflash_core.engine.config import H3Config
from vflash_core.errors import VflashError


def block_lora(config: H3Config, seed: int, rank: int | None, down: str = "lora_down", up: str = "lora_up") -> dict:
    """A LoRA over the original names of every main block's four linears (rank None: a full-rank `diff` delta)."""
    g = torch.Generator().manual_seed(seed)
    h, inner, f = config.hidden_size, config.inner_dim, config.ffn_dim
    shapes = {"attn.qkv_proj": (3 * inner, h), "attn.out_proj": (h, inner), "mlp.fc1": (2 * f, h), "mlp.fc2": (h, f)}
    state = {}
    for i in range(config.num_layers):
        for module, (out_f, in_f) in shapes.items():
            name = f"diffusion_model.blocks.{i}.{module}"
            if rank is None:
                state[f"{name}.diff"] = (torch.randn(out_f, in_f, generator=g) * 0.01).to(torch.bfloat16)
            else:
                state[f"{name}.{down}.weight"] = (torch.randn(rank, in_f, generator=g) * 0.1).to(torch.bfloat16)
                state[f"{name}.{up}.weight"] = (torch.randn(out_f, rank, generator=g) * 0.1).to(torch.bfloat16)
    return state


@pytest.fixture(scope="module")
def demo_root(pack, demo_receipt):
    """The demo family's model root as an official-weights option (diffusers/demo-root), compiled on first use."""
    import importlib

    models = Path(importlib.import_module("folder_paths").models_dir)
    (models / "diffusers").mkdir(parents=True, exist_ok=True)
    (models / "diffusers" / "demo-root").symlink_to(demo_receipt.parent / "model", target_is_directory=True)
    config = H3Config.from_dict(json.loads((demo_receipt.parent / "model" / "transformer" / "config.json").read_text()))
    loras = models / "loras"
    loras.mkdir(exist_ok=True)
    save_file(block_lora(config, 41, 8), str(loras / "turbo_like.safetensors"))
    save_file(block_lora(config, 42, 4, "lora_A", "lora_B"), str(loras / "style.safetensors"))
    save_file(block_lora(config, 43, None), str(loras / "delta.safetensors"))
    return models


def test_three_lora_chain_compiles_once_per_stack_and_makes_an_mp4(pack, demo_root):
    from mp4_probe import probe_mp4

    from vflash_core.engine.artifact import CompiledArtifact

    base = load_api_workflow(API / "t2va.json")
    workflow = {nid: base[nid] for nid in ("1", "2", "3")}
    chain = [("turbo_like.safetensors", 1.0), ("style.safetensors", 0.6), ("delta.safetensors", 0.8)]
    for k, (lora, strength) in enumerate(chain):
        workflow[str(10 + k)] = {"class_type": "VflashLoraSelect", "inputs": {
            "lora": lora, "strength": strength, **({"prev": [str(9 + k), 0]} if k else {})}}
    workflow["1"]["inputs"].update(model="diffusers/demo-root", profile="t2va-base4-exact-cpu", device="cpu", lora=["12", 0], lora_mode="merged")
    workflow["4"] = {"class_type": "VflashGenerate", "inputs": {
        "model": ["1", 0], "te": ["2", 0], "vae": ["3", 0], "prompt": "Waves crash on a rocky shore.", "width": 128, "height": 128,
        "length": 100, "seconds": 5.0, "seed": 3, "force_offload": False}}
    workflow["7"] = {"class_type": "SaveVideo", "inputs": {"video": ["4", 0], "filename_prefix": "video/lora_chain", "format": "auto"}}
    run(pack, workflow)
    assert probe_mp4(next((output_dir() / "video").glob("lora_chain_*.mp4")))["frames"] == 124
    compiled = [p for p in (demo_root / "vflash" / "compiled").iterdir() if p.is_dir() and p.name.startswith("demo-root-")]
    assert len(compiled) == 1 and compiled[0].name.startswith("demo-root-t2va-base4-exact-cpu-turbo_like-")
    stack = CompiledArtifact(compiled[0] / "artifact", compiled[0] / "schedule", compiled[0] / "auxiliary.safetensors").loras
    assert stack["mode"] == "merged" and [(f["name"], f["strength"]) for f in stack["files"]] == [
        ("turbo_like.safetensors", 1.0), ("style.safetensors", 0.6), ("delta.safetensors", 0.8)]


def test_core_lora_loader_feeding_a_vflash_node_is_refused_in_one_line(pack, demo_root):
    from vflash_nodes.graph_checks import core_lora_refusals

    prompt = {
        "5": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3.safetensors", "weight_dtype": "default"}},
        "6": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["5", 0], "lora_name": "style.safetensors", "strength_model": 0.6}},
        "4": {"class_type": "VflashGenerate", "inputs": {"model": ["6", 0]}},
    }
    (refusal,) = core_lora_refusals(prompt)
    assert refusal == (
        "node 6 (LoraLoaderModelOnly) applies a LoRA to a core MODEL, which no Vflash node runs: chain the LoRA with "
        "MiniMax H3 Vflash LoRA Select into the Vflash Model Loader's lora input instead"
    )
    with headless_node_types() as types, pytest.raises(WorkflowError) as info:  # `vflash run-workflow` says the same
        plan(prompt, types)
    assert str(info.value) == refusal
    prompt["4"]["inputs"]["model"] = ["5", 0]
    assert core_lora_refusals(prompt) == []
    with pytest.raises(VflashError, match="LoraLoaderModelOnly"):
        from vflash_nodes.graph_checks import check_graph
        from vflash_nodes.host import FOLDERS, HOST

        prompt["4"]["inputs"]["model"] = ["6", 0]
        check_graph(prompt, HOST, FOLDERS)
