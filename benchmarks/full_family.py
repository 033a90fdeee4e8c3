"""The released MiniMax-H3 family at its real size, with random weights, in the official folder layout, and the plan
that stages it on one machine.

Nothing can be downloaded where the benchmarks run, so the full-size benchmarks write this family themselves, from a
seed. Every component has the released shapes and dtypes:

* `transformer/`: the diffusers `MiniMaxH3Transformer3DModel` folder as released (50 blocks, hidden 5376, 56 x 128
  heads, FFN 14336, bf16 with fp32 patch projections, time embedder and heads: 66.3 GB), in shards of at most 5 GB;
* the Turbo4 LoRA of `t2va-turbo4-exact-sm90` (`minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors`): original
  names, `lora_A`/`lora_B`, rank 128 on the fused QKV, attention output and both FFN matrices, rank 16 on every
  `adaln_proj`, metadata alpha 128 (random factors);
* `text_encoder/`: Qwen3-VL-32B's architecture (64 text layers of width 5120, 64 query / 8 key-value heads of 128,
  intermediate 25600, vocabulary 151936; the 27-layer 1152-wide vision tower with deepstack taps at 8, 16 and 24),
  bf16. H3 reads `hidden_states[50]`, the residual stream after decoder layer 49, so the staged family writes what H3
  reads (embeddings, vision tower, decoder layers 0..49: 52 of the released 66.7 GB; `FamilySpec.text_layers_written`);
* `tokenizer/`, `processor/`: the embedded demo family's (a small byte-level BPE with Qwen's vision tokens; the
  ids it produces are a subset of the full vocabulary), patch 16, merge 2, temporal patch 2;
* `vae/`: `AutoencoderKLMiniMaxH3` at its released configuration (2.6 B parameters, fp32), random latent
  statistics; `audio_vae/`: `AutoencoderKLMiniMaxH3Audio` at its released configuration;
* schedulers and `modular_model_index.json` with the released canvas rules (768 short edge, 768 x 1344 pixels).

Weights are drawn on the GPU per tensor from the seed, so a part can be rebuilt in memory (the diffusers side of the
benchmark does this for the transformer) and equals what was written. The values depend on the device type.

Staging (`StagingPlan`). One `nvidia-h200` machine has 64 GiB free on its disk and a 128 GiB `/dev/shm` tmpfs that
lives in the same ~125 GiB of host memory, so the family fits neither alone. It is written in steps, each checked
against the free space of its place before anything is written and printed with the sizes: the transformer source
into the tmpfs and the LoRA onto the disk, compiled to the disk, the source removed, then the text encoder into the tmpfs (the
model root) and the VAEs onto the disk (the decoder root; pipeline assets name the two roots separately). Every file
in the tmpfs is host memory the runs cannot use, so the plan also states what each pipeline configuration holds in
host memory beside it. A step that is done is recorded in `staging.json` in the work folder and not repeated when a
run resumes.

    python benchmarks/full_family.py --work /root/vflash-work --shm /dev/shm/vflash [--write source|rest]   # the plan; a step
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vflash_core.engine.config import TEXT_ENCODER_LAYER, H3Config
from vflash_core.weights import synthetic
from vflash_core.weights.family import FamilySpec, build_model_family

SEED = 0
TURBO4_LORA = "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors"
TURBO4_RANK, TURBO4_ADALN_RANK, TURBO4_ALPHA = 128, 16, 128.0
GIB = 1 << 30
# Host memory a full-size Vflash process holds besides its weights (CUDA context, allocator pools, decoded frames).
PROCESS_HOST_BYTES = 10 * GIB

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
# What the staged benchmarks write: the text encoder as H3 reads it.
STAGED_FAMILY = replace(FULL_FAMILY, text_layers_written=TEXT_ENCODER_LAYER)


def write_turbo4_lora(path: Path, device: str | torch.device, config: H3Config | None = None) -> Path:
    """The Turbo4 LoRA's layout (random factors) for the released transformer, or for `config`'s."""
    return synthetic.write_random_lora(path, config or H3Config.preset("h3"), TURBO4_RANK, TURBO4_ALPHA, SEED + 10, TURBO4_ADALN_RANK, device)


# -- sizes ------------------------------------------------------------------------------------------------------------


def _meta_state_bytes(module: torch.nn.Module, dtype: torch.dtype, keep=lambda name: True) -> int:
    return sum(math.prod(t.shape) * dtype.itemsize for name, t in module.state_dict().items() if keep(name))


@dataclass(frozen=True)
class FamilyBytes:
    """Bytes of each staged part, from the shapes (nothing written): exact for the files, estimated for the compile."""

    transformer: int  # the diffusers source folder
    lora: int  # the Turbo4 LoRA
    compiled: int  # its compile: the blocks without `adaln_proj`, the auxiliary tensors, the LoRA, the AdaLN tables
    text_encoder: int  # the files written (what H3 reads with `text_layers_written`)
    text_encoder_loaded: int  # what the conditioner loads of them: the same less the LM head
    vaes: int  # video (fp32) and audio VAE

    @classmethod
    def of(cls, spec: FamilySpec) -> FamilyBytes:
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        from vflash_core.weights.family import _text_tensor_written

        config = H3Config.preset(spec.transformer)
        weights = synthetic.RandomWeights(config)
        transformer = sum(weights.nbytes(n) for n in weights)
        adaln = sum(weights.nbytes(n) for n in weights if ".adaln" in n and n.startswith("blocks."))
        h, inner, f = config.hidden_size, config.inner_dim, config.ffn_dim
        lora_elements = TURBO4_RANK * ((h + 3 * inner) + (inner + h) + (h + 2 * f) + (f + h)) + TURBO4_ADALN_RANK * (config.time_embed_dim + 18 * h)
        lora = config.num_layers * lora_elements * 2
        tables = 8 * config.num_layers * 18 * h * 2  # a handful of (step, vector) tables per block, bf16
        text = Qwen3VLConfig(text_config={**spec.text, "vocab_size": spec.text_vocab_size or 151936}, vision_config=spec.vision, tie_word_embeddings=False)
        with torch.device("meta"):
            encoder = Qwen3VLForConditionalGeneration(text)
            video, audio = AutoencoderKLMiniMaxH3(**spec.video_vae), AutoencoderKLMiniMaxH3Audio(**spec.audio_vae)
        written = lambda name: _text_tensor_written(spec.text_layers_written, name)
        text_bytes = _meta_state_bytes(encoder, torch.bfloat16, written)
        loaded = _meta_state_bytes(encoder, torch.bfloat16, lambda n: written(n) and n != "lm_head.weight"
                                   and not any(n.startswith(f"model.language_model.layers.{i}.") for i in range(TEXT_ENCODER_LAYER, spec.text["num_hidden_layers"])))
        return cls(transformer, lora, transformer - adaln + lora + tables, text_bytes, loaded,
                   _meta_state_bytes(video, torch.float32) + _meta_state_bytes(audio, torch.float32))


# -- the machine and the plan -----------------------------------------------------------------------------------------


def host_memory_bytes() -> int:
    """The machine's host memory: VFLASH_HOST_MEMORY_GIB when set, else MemTotal. (A lent machine's RAM can start small
    and grow as it is used, so its MemTotal understates what it has: the run sets the kind's figure.)"""
    if os.environ.get("VFLASH_HOST_MEMORY_GIB"):
        return int(float(os.environ["VFLASH_HOST_MEMORY_GIB"]) * GIB)
    return _meminfo("MemTotal")


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def host_memory_in_use() -> int:
    """Host memory in use now, tmpfs files included (MemTotal - MemAvailable)."""
    return _meminfo("MemTotal") - _meminfo("MemAvailable")


def host_memory_free() -> int:
    """What a process may still take: the machine's host memory (`host_memory_bytes`) less what is in use."""
    return host_memory_bytes() - host_memory_in_use()


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Step:
    name: str
    place: str  # "disk" or "shm"
    delta: int  # bytes written (> 0) or removed (< 0)


class StagingPlan:
    """Where each part is written, in order, and what the two places and host memory hold after each step.

    `disk`: the work folder's file system; `shm`: a tmpfs in host memory. Host memory holds the tmpfs files and, while
    a pipeline runs, what it holds in host memory (`host_needs`)."""

    def __init__(self, sizes: FamilyBytes, disk_free: int, shm_free: int, host_bytes: int):
        self.sizes, self.disk_free, self.shm_free, self.host_bytes = sizes, disk_free, shm_free, host_bytes
        s = sizes
        self.steps = [
            Step("transformer source -> shm", "shm", s.transformer), Step("Turbo4 LoRA -> disk", "disk", s.lora),
            Step("compile -> disk", "disk", s.compiled), Step("remove the transformer source", "shm", -s.transformer),
            Step("text encoder (layers 0..49) -> shm", "shm", s.text_encoder), Step("VAEs -> disk", "disk", s.vaes),
        ]
        self.after: list[dict[str, int]] = []
        used = {"disk": 0, "shm": 0}
        for step in self.steps:
            used[step.place] += step.delta
            self.after.append(dict(used))
        self.shm_resident = used["shm"]  # what the tmpfs holds while the pipelines run

    def host_needs(self) -> dict[str, int]:
        """Host memory each configuration holds beside the tmpfs files (an estimate from the part sizes)."""
        s = self.sizes
        return {
            "resident": PROCESS_HOST_BYTES,
            "encoder offload (the default)": PROCESS_HOST_BYTES + s.text_encoder_loaded,
            "block-ring": PROCESS_HOST_BYTES + s.compiled,
            "streamed text encoder": PROCESS_HOST_BYTES + s.text_encoder_loaded,
            "block-ring + streamed text encoder (20 / 24 GiB)": PROCESS_HOST_BYTES + s.compiled + s.text_encoder_loaded + s.vaes,
        }

    def problems(self) -> list[str]:
        out = []
        for step, used in zip(self.steps, self.after):
            for place, free in (("disk", self.disk_free), ("shm", self.shm_free)):
                if used[place] > free:
                    out.append(f"after '{step.name}' the {place} holds {_gib(used[place])}, {_gib(free)} are free")
            if used["shm"] + PROCESS_HOST_BYTES > self.host_bytes:
                out.append(f"after '{step.name}' the tmpfs holds {_gib(used['shm'])} of {_gib(self.host_bytes)} host memory")
        return out

    def lines(self) -> list[str]:
        s = self.sizes
        out = [
            f"staging plan: disk {_gib(self.disk_free)} free, /dev/shm {_gib(self.shm_free)} free, host memory {_gib(self.host_bytes)}",
            (f"  sizes: transformer {_gib(s.transformer)}, LoRA {_gib(s.lora)}, compiled ~{_gib(s.compiled)}, "
             f"text encoder {_gib(s.text_encoder)} (loads {_gib(s.text_encoder_loaded)}), VAEs {_gib(s.vaes)}"),
        ]
        out += [f"  {i + 1}. {st.name:38s} disk {_gib(a['disk']):>9s}  shm {_gib(a['shm']):>9s}" for i, (st, a) in enumerate(zip(self.steps, self.after))]
        for name, need in self.host_needs().items():
            total = self.shm_resident + need
            verdict = "fits" if total <= self.host_bytes else "does not fit: the run removes the text encoder's tmpfs files once it has read them"
            out.append(f"  host memory, {name}: {_gib(self.shm_resident)} tmpfs + {_gib(need)} = {_gib(total)} of {_gib(self.host_bytes)}: {verdict}")
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "sizes": vars(self.sizes), "disk_free": self.disk_free, "shm_free": self.shm_free, "host_bytes": self.host_bytes,
            "steps": [{"step": st.name, "place": st.place, "delta": st.delta, **{f"{k}_after": v for k, v in a.items()}} for st, a in zip(self.steps, self.after)],
            "host_needs": self.host_needs(), "shm_resident": self.shm_resident, "problems": self.problems(),
        }


class StagedFamily:
    """The staged family's places and which steps are done (`staging.json` in the work folder, so a resumed run
    repeats none of them)."""

    def __init__(self, work: Path, shm: Path, spec: FamilySpec = STAGED_FAMILY, device: str = "cuda"):
        self.work, self.shm, self.spec, self.device = Path(work), Path(shm), spec, device
        self.source = self.shm / "source" / "transformer"
        self.lora = self.work / TURBO4_LORA
        self.model_root = self.shm / "model"  # text encoder, tokenizer, processor, schedulers, index
        self.decoder_root = self.work / "model"  # VAEs, schedulers, index
        self.compiled = self.work / "compiled"  # the source's compile (written by the benchmark's first use)
        self.record_path = self.work / "staging.json"
        self.done: dict[str, dict] = json.loads(self.record_path.read_text()) if self.record_path.exists() else {}

    def plan(self) -> StagingPlan:
        self.work.mkdir(parents=True, exist_ok=True)
        self.shm.mkdir(parents=True, exist_ok=True)
        # What this staging has written already (the compile included) counts as free: the plan is for the whole family.
        written = {"disk": sum(r.get("bytes", 0) for k, r in self.done.items() if r.get("place") == "disk"),
                   "shm": sum(r.get("bytes", 0) for k, r in self.done.items() if r.get("place") == "shm" and not r.get("removed"))}
        if self.compiled.exists():
            written["disk"] += folder_bytes(self.compiled)
        return StagingPlan(FamilyBytes.of(self.spec), shutil.disk_usage(self.work).free + written["disk"],
                           shutil.disk_usage(self.shm).free + written["shm"], host_memory_bytes())

    def _record(self, step: str, place: str, path: Path, seconds: float, **extra: object) -> None:
        self.done[step] = {"place": place, "path": str(path), "bytes": folder_bytes(path), "seconds": round(seconds, 3), **extra}
        self.record_path.write_text(json.dumps(self.done, indent=2) + "\n")

    def write_source(self) -> dict:
        """The transformer source (into the tmpfs) and the Turbo4 LoRA (onto the disk)."""
        if "source" not in self.done:
            start = time.perf_counter()
            build_model_family(self.source.parent, self.spec, SEED, with_ref=False, parts=("transformer",), device=self.device, write_workers=8)
            self._record("source", "shm", self.source.parent, time.perf_counter() - start)
        if "lora" not in self.done:
            start = time.perf_counter()
            write_turbo4_lora(self.lora, self.device, H3Config.preset(self.spec.transformer))
            self._record("lora", "disk", self.lora, time.perf_counter() - start)
        return {k: self.done[k] for k in ("source", "lora")}

    def remove_source(self) -> None:
        shutil.rmtree(self.source.parent, ignore_errors=True)
        if "source" in self.done:
            self.done["source"]["removed"] = True
            self.record_path.write_text(json.dumps(self.done, indent=2) + "\n")

    def write_rest(self) -> dict:
        """The text encoder, tokenizer, processor and index into the tmpfs; the VAEs and the index onto the disk."""
        if "text" not in self.done:
            start = time.perf_counter()
            build_model_family(self.model_root, self.spec, SEED, with_ref=False, parts=("text", "index"), device=self.device, write_workers=8)
            self._record("text", "shm", self.model_root, time.perf_counter() - start)
        if "vaes" not in self.done:
            start = time.perf_counter()
            build_model_family(self.decoder_root, self.spec, SEED, with_ref=False, parts=("vaes", "index"), device=self.device, write_workers=8)
            self._record("vaes", "disk", self.decoder_root, time.perf_counter() - start)
        return {k: self.done[k] for k in ("text", "vaes")}

    def text_encoder_files(self) -> list[Path]:
        return sorted((self.model_root / "text_encoder").glob("*.safetensors"))

    def remove_text_encoder_files(self) -> None:
        """Unlink the text encoder's weight files (a process that has them mapped keeps its pages until it lets go);
        `write_rest` writes them again."""
        for path in self.text_encoder_files():
            path.unlink()
        self.done.pop("text", None)
        self.record_path.write_text(json.dumps(self.done, indent=2) + "\n")


def folder_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder on the disk (compiled weights, VAEs)")
    parser.add_argument("--shm", type=Path, required=True, help="folder on a tmpfs (transformer source, text encoder)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--write", choices=("source", "rest"), help="write one step's parts (the source first; compile it and remove it before 'rest')")
    args = parser.parse_args()
    staged = StagedFamily(args.work, args.shm, device=args.device)
    plan = staged.plan()
    print("\n".join(plan.lines()))
    if plan.problems():
        raise SystemExit("the family does not fit this machine: " + "; ".join(plan.problems()))
    if args.write:
        record = staged.write_source() if args.write == "source" else staged.write_rest()
        print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
