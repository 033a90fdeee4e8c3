"""The weights compiler: H3 weights (+ LoRA) -> packed blocks, auxiliary tensors and a schedule overlay.

Verbs (`python -m vflash_core.weights.compiler prepare|compile|verify`):

* `prepare` binds a profile to the identities of the base weights and the adapter (file names, sizes, sha256 of
  each payload, config), and of a LoRA stack after it (each file's identity and strength, in order, and the mode:
  residual or merged), in a receipt. No request data is involved.
* `compile` checks the files against the receipt (re-hashing only those whose size or modification time changed
  since `prepare`), then writes, atomically, a folder with

  - `artifact/`: one `block_NNN.safetensors` per main block: the unchanged matrices in their stored dtype with the
    fused QKV `[3*inner, H]` and fused SwiGLU input `[2*ffn, H]` (a merged stack added in), plus the block's LoRA
    factors (residual mode); no `adaln_proj`
    (39 % of the model) — the runtime never loads it;
  - `auxiliary.safetensors`: input projections, context embedder, token refiner, final norm and output heads (plus
    their LoRA factors);
  - `schedule/overlay.safetensors`: for every step of the profile's fixed schedule and every distinct-timestep vector
    a request of the profile can present, `temb`, each block's AdaLN table and the `norm_out` shift/scale, computed
    on the target device from exactly that vector (the fp32 `time_embedder` GEMM is not row-invariant), with any
    LoRA on `adaln_proj`, `time_embedder` or `norm_out` folded in (a pruned file, for a -pruned profile: from its
    `adaln_t_table` curve and reduced-rank projections, see `model.curve_time_embedding`);
  - a `manifest.json` in `artifact/` and `schedule/` (and metadata in the auxiliary file) carrying one compile id,
    the profile identity, the config, the device architecture, the base weights' form (`format`: "bf16", or
    "fp8_scaled" / "int8_convrot" / "int8" / "gguf", dequantized as it is read, with `quant_types` and the
    `dequantized` line saying how; `pruned`) and the size and sha256 of every file.

  For an FP8 profile (approximate, `Profile.fp8`) the artifact is of its own kind (`ARTIFACT_FP8_FORMAT`): each
  block's four linears are quantized on the compile device to E4M3 codes (`<linear>.weight`) with FP32 row scales
  (`<linear>.weight_scale`, [out, 1]) by `fp8.quantize_block`; everything else is the BF16 artifact's. From an
  fp8_scaled file the linears it stores as E4M3 are not quantized again: its codes are copied as they are and its
  per-tensor scale repeated per row (`SourceWeights.read_codes`); the manifest's `fp8` record says which
  (`source_format`, `origin`: "kept", "quantized" or "mixed").

Loading (see `artifact.py`) checks format, compile id, identities and sizes, and never rehashes the model; `verify`
re-hashes a compiled folder against the sha256 of every file recorded as it was written.

The receipt is `receipt.py`'s (`prepare`, and reading it back); what `compile` writes, `artifact_writer.py`'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..engine.artifact import CompiledArtifact
from ..errors import run_command
from ..fileio import atomic_directory, check_folder, check_new_directory, path_argument
from ..formats import GPU_INDEX, check_device, device_arch, gpu_device
from ..progress import StageProgress
from .artifact_writer import write_compiled
from .checkpoint import SourceWeights
from .lora import LORA_MODES, LoraStack, StackedLora
from .receipt import (
    compiled_from,
    load_adapters,
    load_receipt,
    prepare,
    profile_from_receipt,
    receipt_describes,
    verify_receipt_files,
)

# `prepare`, `receipt_describes` and `compiled_from` (receipt.py) are the compiler's API as the docs and nodes use it.
__all__ = ["build_parser", "compile_receipt", "compiled_from", "main", "prepare", "receipt_describes"]

# Progress stages (`StageProgress`), after each unit of work: "hash" (prepare, per weight file), "verify" (compile,
# per weight file), "compile" (per block). A callback that raises abandons the call; nothing is published then.

logger = logging.getLogger(__name__)


def compile_receipt(
    receipt_path: str | Path, output: str | Path, device: str = "cpu", progress: StageProgress | None = None
) -> Path:
    """Compile the receipt's weights for its profile into `output` (must not exist). Returns `output`."""
    receipt_path, output = path_argument(receipt_path, "the receipt"), path_argument(output, "the output folder")
    receipt = load_receipt(receipt_path)
    profile = profile_from_receipt(receipt, receipt_path)

    device_t = check_device(device, profile.arch, profile_id=profile.id)  # before anything is read
    arch = device_arch(device_t)
    output = check_new_directory(output)  # before the weights are read and hashed
    tx = receipt["transformer"]
    source = SourceWeights(tx["path"], qkv_layout=None if tx["layout"] == "diffusers" else tx["qkv_layout"])
    source.check_profile(profile)
    verify_receipt_files(receipt, source, progress)
    stack = load_adapters(receipt, profile, source.config)
    with atomic_directory(output) as tmp:
        write_compiled(tmp, source, stack, profile, receipt, device_t, arch, progress)
    logger.info("compiled %s for %s into %s", tx["path"], profile.id, output)
    return output


# -- command line ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vflash_core.weights.compiler", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="bind a profile to base weights (and adapter) in a receipt")
    p.add_argument(
        "--profile", required=True, help="profile id the weights are compiled for, e.g. t2va-base16-bf16-sm90"
    )
    p.add_argument(
        "--transformer", required=True,
        help="diffusers transformer/ folder, or an original-layout file/folder (Comfy-Org bf16, fp8_scaled, "
        "int8_convrot or pruned single files, and GGUF files, too)",
    )
    p.add_argument("--adapter", help="LoRA .safetensors the profile is built with")
    p.add_argument(
        "--lora", action="append", default=[], metavar="FILE[:STRENGTH]", type=_stacked_lora,
        help="a LoRA stacked after the profile's adapter (repeat, in order; strength 1 unless given)",
    )
    p.add_argument(
        "--lora-mode", choices=LORA_MODES, default="residual",
        help="residual: separate low-rank residuals at every evaluation (as peft adapters); merged: added into the "
        "weights at compile (as fuse_lora), no per-evaluation cost",
    )
    p.add_argument("--qkv-layout", choices=("stacked", "interleaved"), help="original layout only (default stacked)")
    p.add_argument("--receipt", required=True, help="receipt JSON to write (must not exist)")
    c = sub.add_parser("compile", help="compile a receipt into artifact/, schedule/ and auxiliary.safetensors")
    c.add_argument("--receipt", required=True, help="receipt written by `prepare`")
    c.add_argument(
        "--output", required=True, help="folder to write (must not exist): artifact/, schedule/, auxiliary.safetensors"
    )
    c.add_argument("--device", default="cpu", help="cpu or cuda:N (the profile's architecture)")
    c.add_argument("--gpu", type=GPU_INDEX.option("--gpu"), help="shorthand for --device cuda:N")
    v = sub.add_parser("verify", help="re-hash a compiled folder against the sha256 recorded when it was written")
    v.add_argument("compiled", help="folder holding artifact/, schedule/ and auxiliary.safetensors")
    return parser


def _stacked_lora(text: str) -> StackedLora:
    """FILE or FILE:STRENGTH (the last colon, where what follows is a number: a path may hold colons)."""
    path, _, strength = text.rpartition(":")
    try:
        return StackedLora(path, float(strength)) if path else StackedLora(text)
    except ValueError:
        return StackedLora(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()

    def run() -> None:
        args = parser.parse_args(argv)  # inside: a refused number is a one-line error too
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        _run(args)

    return run_command(run, "error: ", "interrupted; nothing was published")


def _run(args: argparse.Namespace) -> None:
    if args.command == "prepare":
        prepare(
            args.profile, args.transformer, args.receipt, args.adapter, args.qkv_layout,
            loras=LoraStack(tuple(args.lora), args.lora_mode),
        )
        print(f"wrote receipt {args.receipt}")
    elif args.command == "verify":
        folder = check_folder(
            args.compiled, hint="give the folder compile wrote (artifact/, schedule/, auxiliary.safetensors)"
        )
        CompiledArtifact(folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors").verify()
        print(f"{folder}: every file matches the sha256 recorded at compile time")
    else:
        out = compile_receipt(args.receipt, args.output, gpu_device(args.gpu, args.device))
        print(f"compiled into {out}: artifact/, schedule/, auxiliary.safetensors")


if __name__ == "__main__":
    sys.exit(main())
