"""The released MiniMax-H3 family at its real size, with random weights, in the official folder layout.

Nothing can be downloaded where the benchmarks run, so the end-to-end benchmark writes this family itself, from a
seed. Every component has the released shapes and dtypes:

* `transformer/`: the diffusers `MiniMaxH3Transformer3DModel` folder as released (50 blocks, hidden 5376, 56 x 128
  heads, FFN 14336, bf16 with fp32 patch projections, time embedder and heads: 66.3 GB), in shards of at most 5 GB;
* the Turbo4 LoRA of `t2va-turbo4-exact-sm90` (`minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors`): original
  names, `lora_A`/`lora_B`, rank 128 on the fused QKV, attention output and both FFN matrices, rank 16 on every
  `adaln_proj`, metadata alpha 128 (random factors);
* `text_encoder/`: Qwen3-VL-32B's architecture (64 text layers of width 5120, 64 query / 8 key-value heads of 128,
  intermediate 25600, vocabulary 151936; the 27-layer 1152-wide vision tower with deepstack taps at 8, 16 and 24),
  bf16, 66.7 GB. H3 reads `hidden_states[50]`, the residual stream after decoder layer 49;
* `tokenizer/`, `processor/`: the embedded demo family's (a small byte-level BPE with Qwen's vision tokens; the
  ids it produces are a subset of the full vocabulary), patch 16, merge 2, temporal patch 2;
* `vae/`: `AutoencoderKLMiniMaxH3` at its released configuration (2.6 B parameters, fp32), random latent
  statistics; `audio_vae/`: `AutoencoderKLMiniMaxH3Audio` at its released configuration;
* schedulers and `modular_model_index.json` with the released canvas rules (768 short edge, 768 x 1344 pixels).

Weights are drawn on the GPU per tensor from the seed, so a part can be rebuilt in memory (the diffusers side of the
benchmark does this for the transformer) and equals what was written. The values depend on the device type.

    python benchmarks/full_family.py ROOT [--parts transformer text vaes index] [--device cuda] [--lora PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from vflash_core.engine.config import H3Config
from vflash_core.weights import synthetic
from vflash_core.weights.family import FamilySpec, build_model_family

SEED = 0
TURBO4_LORA = "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors"
TURBO4_RANK, TURBO4_ADALN_RANK, TURBO4_ALPHA = 128, 16, 128.0

FULL_FAMILY = FamilySpec(
    transformer="h3",
    text=dict(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ),
    vision=dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=5120, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
        hidden_act="gelu_pytorch_tanh",
    ),
    video_vae={},  # the class defaults are the released configuration
    audio_vae={},
    text_vocab_size=151936,
    max_shard_bytes=5 * 10**9,
)


def write_turbo4_lora(path: Path, device: str | torch.device) -> Path:
    return synthetic.write_random_lora(path, H3Config.preset("h3"), TURBO4_RANK, TURBO4_ALPHA, SEED + 10, TURBO4_ADALN_RANK, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--parts", nargs="+", default=["transformer", "text", "vaes", "index"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--write-workers", type=int, default=8)
    parser.add_argument("--lora", type=Path, help=f"also write the Turbo4 LoRA here (name it {TURBO4_LORA})")
    args = parser.parse_args()
    start = time.perf_counter()
    build_model_family(args.root, FULL_FAMILY, SEED, with_ref=False, parts=tuple(args.parts), device=args.device, write_workers=args.write_workers)
    if args.lora:
        write_turbo4_lora(args.lora, args.device)
    print(f"wrote {', '.join(args.parts)} into {args.root} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
