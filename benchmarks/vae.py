"""diffusers vs Vflash video decode of the H3 video VAE at its released size (random weights), one process, one H200.

    python benchmarks/vae.py [--cache /tmp/vflash-bench] [--windows-per-call 1 8] [--attention torch-sdpa] [--repeat 2]
                             [--canvases 960x544 1344x768] [--durations 5 10] [--profile] [--fused-windows-per-call 4 8]
    python benchmarks/vae.py --small        # dry run: the demo family's VAE on the CPU (also bf16)

The VAE has the released configuration (`AutoencoderKLMiniMaxH3()` defaults: a 36-layer ViT decoder 2048 wide) with
random weights, written once into --cache by the family builder and loaded as the pipeline loads it
(`MediaVAEs.from_pretrained`: bf16 with diffusers' fp32 pins). For each canvas (960x544, 1344x768) and duration (5 s,
10 s) both sides decode the same random latents: diffusers' `vae.decode`, and `NativeVideoDecoder.decode` handing the
frames to the host window by window, for each --windows-per-call (tile-windows per ViT call; 1 issues the reference's
shapes). Times are wall seconds around the whole decode (synchronised), medians of --repeat after one warm-up decode
per side; `vflash_seconds` is the fastest --windows-per-call. `peak_device_bytes` is `torch.cuda.max_memory_allocated`
over a decode, the resident VAE included; diffusers keeps its whole output on the device, Vflash copies each window's
frames out as it completes.

`bitwise_equal_to_diffusers` compares the pixels (bf16, ImageNet space) of every --windows-per-call with diffusers';
`max_abs_diff_pixels` is the largest difference after the pipeline's mapping to [0, 1], in 0..255 units (0 when
bitwise; what to report for a different attention kernel, e.g. --attention fa3).

Roofline: the decoder's GEMM FLOPs (`proj_in`, the blocks' projections, `proj_out`) at the sustained rate of an
8192^3 BF16 GEMM, plus its attention FLOPs at the sustained rate of the same attention call on one ViT call's shape,
both measured on this GPU after the timings (`_common.sustained_ms`); `roofline_ratio` = vflash_seconds / that.

With two GPUs, the same decode (the largest --windows-per-call) split over cuda:0 and cuda:1 as the pipeline runs it
with a peer device: the calls in two contiguous halves, cuda:1's on a replica of the decoder weights made inside the
timing (the pipeline makes it per decode), its tiles gathered on cuda:0. `two_gpu_speedup` = one-GPU time / two-GPU
time, `two_gpu_bitwise_equal` against one GPU, `two_gpu_peak_device_bytes` per device; all three null (and the other
two absent) without two GPUs.
`native_fused_seconds` (with `native_fused_peak_device_bytes`, `native_fused_bitwise_equal_to_diffusers`,
`native_fused_speedup_vs_reference` against the reference ops at the largest --windows-per-call,
`native_fused_speedup_vs_diffusers` and `native_fused_roofline_ratio`): the native decode through its fused Triton ops
(`decoder_execution="fused"`, the default on CUDA) at the default tile-windows per call
(`DEFAULT_WINDOWS_PER_CALL`, or the largest --fused-windows-per-call without it); null on the CPU.
`native_fused_by_windows_per_call` holds the same decode at each --fused-windows-per-call (default: the largest
--windows-per-call): seconds, peak, bitwise. `resident_device_bytes` is what was allocated before the decodes (the two
VAEs), `native_fused_working_bytes` the fused peak above it, and `native_decode_bytes_estimate` the memory plan's
estimate of that working memory (`vae.decode_bytes`, which must not be below it).
`vflash_seconds` and the columns beside it are the reference ops' (`decoder_execution="reference"`). With --profile,
the first canvas and duration's record also holds `native_fused_kernel_profile`: one fused decode's kernel time and
its top kernels by device time.
`audio_decode_seconds`, `audio_peak_device_bytes`: the audio VAE's decode of the same duration (both stereo channels);
`audio_share_of_decode` = audio / (audio + Vflash video) seconds, its share of the decode stage (worth speeding up
above 5 %).

Writes benchmarks/results/vae_h200.json (--small: vae_small_cpu.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import attention_flops, environment, gemm_tflops, sustained_ms, write_result

from vflash_core.engine.layout import audio_latent_count, frames_for_duration, video_latent_frames
from vflash_core.media.vae import PIXEL_MEAN, PIXEL_STD, MediaVAEs, decode_bytes
from vflash_core.media.vae_decode import DEFAULT_WINDOWS_PER_CALL, NativeVideoDecoder
from vflash_core.media.vae_vit import DecoderWeights
from vflash_core.weights.family import DEMO_FAMILY, FamilySpec, build_model_family

SEED = 0
CANVASES = {"960x544": (544, 960), "1344x768": (768, 1344)}
# The demo VAE on the CPU: 2 x 1 tiles of 256 px.
SMALL_CANVASES = {"320x256": (256, 320)}
SECONDS = (5.0, 10.0)


def family_spec() -> FamilySpec:
    from full_family import FULL_FAMILY

    return FULL_FAMILY


def load_vaes(cache: Path, spec: FamilySpec, device: torch.device) -> MediaVAEs:
    """The family's VAEs, written once under `cache`, loaded like the pipeline's and resident on `device`."""
    root = cache / ("vae-family-demo" if spec is DEMO_FAMILY else "vae-family-released")
    if not (root / "vae").exists():
        build_model_family(root, spec, SEED, with_ref=False, parts=("vaes",), device=device, write_workers=8)
    vaes = MediaVAEs.from_pretrained(root, device, dtype=torch.bfloat16)
    vaes.video_vae.to(device)
    vaes.audio_vae.to(device)
    return vaes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, int | None, object]:
    """(median seconds over `repeat` calls, peak device bytes of the last call or None off CUDA, its result)."""
    times, result, peak = [], None, None
    for _ in range(repeat):
        result = None
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), peak, result


def decoder_flops(weights: DecoderWeights, tile_windows: int, tokens: int, rows: int) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of the ViT decoder over `tile_windows` sequences of `rows` rows (`tokens` of them
    latent voxels)."""
    block_params = sum(
        t.numel() for b in weights.blocks for t in (b.to_q, b.to_k, b.to_v, b.to_out, b.ff_in, b.ff_out)
    )
    per_window = 2.0 * (tokens * weights.proj_in.numel() + rows * (block_params + weights.proj_out.numel()))
    heads, head_dim = weights.heads, weights.blocks[0].to_q.shape[0] // weights.heads
    return tile_windows * per_window, tile_windows * len(weights.blocks) * attention_flops(rows, heads, head_dim)


def attention_rate_tflops(decoder: NativeVideoDecoder, count: int, rows: int) -> float:
    """Sustained TFLOP/s of the decoder's attention call on (count, rows, heads, head_dim) in the compute dtype."""
    w = decoder.weights[0]
    heads, head_dim = w.heads, w.blocks[0].to_q.shape[0] // w.heads
    q, k, v = (torch.randn(count, rows, heads, head_dim, device=w.device, dtype=w.compute_dtype) for _ in range(3))
    ms = sustained_ms(lambda: decoder.ops[0].attend(q, k, v))
    return count * attention_flops(rows, heads, head_dim) / ms / 1e9


def two_gpu_decode(vae: torch.nn.Module, z: torch.Tensor, devices: list[torch.device], attention: str, windows_per_call: int,
                   one_gpu_seconds: float, one_gpu: torch.Tensor, repeat: int) -> dict[str, object]:
    """The decode split over two devices, replica of the weights included, against one device's time and pixels."""

    def decode() -> torch.Tensor:
        return NativeVideoDecoder.from_vae(vae, devices=devices, attention=attention, windows_per_call=windows_per_call).decode(z)

    decode()  # warm-up: the second device's kernels and allocator
    times, peaks, pixels = [], None, None
    cuda = devices[0].type == "cuda"
    for _ in range(repeat):
        pixels = None
        synchronize(devices[0])
        for d in devices if cuda else ():
            torch.cuda.reset_peak_memory_stats(d)
        start = time.perf_counter()
        pixels = decode()
        synchronize(devices[0])
        times.append(time.perf_counter() - start)
        peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in devices} if cuda else None
    seconds = statistics.median(times)
    return {"two_gpu_seconds": round(seconds, 4), "two_gpu_speedup": round(one_gpu_seconds / seconds, 4),
            "two_gpu_bitwise_equal": torch.equal(pixels, one_gpu), "two_gpu_peak_device_bytes": peaks}


def to_unit(video: torch.Tensor) -> torch.Tensor:
    """The pipeline's mapping of (1, 3, F, H, W) ImageNet-space pixels to [0, 1], on the CPU."""
    mean, std = torch.tensor(PIXEL_MEAN).view(1, -1, 1, 1, 1), torch.tensor(PIXEL_STD).view(1, -1, 1, 1, 1)
    return (video.cpu().float() * std + mean).clamp(0, 1)


def max_abs_diff_pixels(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference in 0..255 units after the mapping to [0, 1], frame by frame (bounded host memory)."""
    return max(
        (to_unit(actual[:, :, i : i + 1]) - to_unit(expected[:, :, i : i + 1])).abs().max().item() * 255 for i in range(actual.shape[2])
    )


def kernel_profile(fn: Callable[[], object], top: int = 25) -> dict[str, object]:
    """One call of `fn` under the CUDA profiler: its kernel time in all and the `top` kernels by their summed device
    time (name cut to 90 characters, milliseconds, launches, share of the kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "kernel_ms": round(total_us / 1e3, 1),
        "top": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 1), "launches": e.count,
                 "share": round(e.self_device_time_total / total_us, 4)} for e in kernels[:top]],
    }


def run(vaes: MediaVAEs, device: torch.device, canvases: dict[str, tuple[int, int]], windows_per_call: list[int], attention: str, repeat: int,
        durations: tuple[float, ...] = SECONDS, profile_kernels: bool = False,
        fused_windows_per_call: list[int] | None = None) -> dict[str, object]:
    """`profile_kernels`: also a CUDA kernel profile of the first canvas and duration's fused decode."""
    vae = vaes.video_vae
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    decoders = {n: NativeVideoDecoder.from_vae(vae, attention=attention, windows_per_call=n, execution="reference")
                for n in windows_per_call}
    best_n = max(windows_per_call)
    # Triton kernels run on CUDA only: on the CPU (--small) the fused keys stay null.
    fused_by_n = {n: NativeVideoDecoder.from_vae(vae, attention=attention, windows_per_call=n, execution="fused")
                  for n in (fused_windows_per_call or [best_n])} if device.type == "cuda" else {}
    fused_n = DEFAULT_WINDOWS_PER_CALL if DEFAULT_WINDOWS_PER_CALL in fused_by_n else max(fused_by_n, default=None)
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    channels, ratio = vaes.latent_channels, vae.spatial_compression_ratio
    g = torch.Generator().manual_seed(SEED)
    records = []
    warm = False
    for canvas, (height, width) in canvases.items():
        for seconds in durations:
            frames = frames_for_duration(seconds)
            z = torch.randn(1, channels, video_latent_frames(frames), height // ratio, width // ratio, generator=g).to(device)
            if not warm:  # one decode per side first: kernel selection, allocator growth
                with torch.no_grad():
                    vae.decode(z, return_dict=False)
                for decoder in [*decoders.values(), *fused_by_n.values()]:
                    decoder.decode(z)
                warm = True
            with torch.no_grad():
                d_seconds, d_peak, expected = timed(lambda z=z: vae.decode(z, return_dict=False)[0], device, repeat)
            expected = expected.cpu()
            by_n = {}
            for n, decoder in decoders.items():
                seconds_n, peak_n, got = timed(partial(decoder.decode, z), device, repeat)
                by_n[n] = {"seconds": round(seconds_n, 4), "peak_device_bytes": peak_n, "bitwise_equal_to_diffusers": torch.equal(got, expected),
                           "max_abs_diff_pixels": max_abs_diff_pixels(got, expected)}
                print(canvas, seconds, f"windows_per_call={n}", by_n[n])
                del got
            best = min(by_n, key=lambda n: by_n[n]["seconds"])
            v_seconds = by_n[best]["seconds"]

            plan = decoders[best].plan(z.shape)
            tile_windows = len(plan.tile_windows())
            tokens = plan.window_latents * plan.tile_height * plan.tile_width
            rows = tokens + decoders[best].weights[0].register_tokens.shape[1] + 1
            gemm, attn = decoder_flops(decoders[best].weights[0], tile_windows, tokens, rows)
            record: dict[str, object] = {
                "canvas": canvas,
                "seconds": seconds,
                "frames": frames,
                "latent_shape": list(z.shape),
                "tile_windows": tile_windows,
                "diffusers_seconds": round(d_seconds, 4),
                "vflash_seconds": v_seconds,
                "speedup_vs_diffusers": round(d_seconds / v_seconds, 4),
                "peak_device_bytes": {"diffusers": d_peak, "vflash": by_n[best]["peak_device_bytes"]},
                "bitwise_equal_to_diffusers": all(r["bitwise_equal_to_diffusers"] for r in by_n.values()),
                "max_abs_diff_pixels": max(r["max_abs_diff_pixels"] for r in by_n.values()),
                "windows_per_call": best,
                "by_windows_per_call": by_n,
                "attention_backend": decoders[best].attention_backend,
                "decoder_gemm_tflop": round(gemm / 1e12, 3),
                "decoder_attention_tflop": round(attn / 1e12, 3),
                "roofline_ratio": None,
                "two_gpu_speedup": None,
                "two_gpu_bitwise_equal": None,
                "two_gpu_peak_device_bytes": None,
                "native_fused_seconds": None,
                "native_fused_peak_device_bytes": None,
                "native_fused_bitwise_equal_to_diffusers": None,
                "native_fused_speedup_vs_reference": None,
                "resident_device_bytes": resident,
                "native_decode_bytes_estimate": decode_bytes(vae, frames, height, width, "native", fused_n or best_n),
            }
            if device.type == "cuda":
                gemm_rate = gemm_tflops(sustained=True)
                attention_rate = attention_rate_tflops(decoders[best], best, rows)
                roofline = gemm / (gemm_rate * 1e12) + attn / (attention_rate * 1e12)
                record.update(gemm_tflops=round(gemm_rate, 1), attention_tflops=round(attention_rate, 1), roofline_seconds=round(roofline, 4),
                              roofline_ratio=round(v_seconds / roofline, 4))
            if two_gpus:
                pair = [torch.device("cuda:0"), torch.device("cuda:1")]
                record.update(two_gpu_decode(vae, z, pair, attention, best_n, by_n[best_n]["seconds"], decoders[best_n].decode(z), repeat))
            audio = torch.randn(2, vaes.audio_latent_channels, audio_latent_count(frames), generator=g)
            audio_seconds, audio_peak, _ = timed(partial(vaes.decode_audio, audio), device, repeat)
            record.update(audio_decode_seconds=round(audio_seconds, 4), audio_peak_device_bytes=audio_peak,
                          audio_share_of_decode=round(audio_seconds / (audio_seconds + v_seconds), 4))
            fused_records = {}
            for n, fused in fused_by_n.items():  # the same decode through the fused ops (`decoder_execution="fused"`)
                f_seconds, f_peak, got = timed(partial(fused.decode, z), device, repeat)
                fused_records[n] = {"seconds": round(f_seconds, 4), "peak_device_bytes": f_peak,
                                    "bitwise_equal_to_diffusers": torch.equal(got, expected)}
                print(canvas, seconds, f"fused windows_per_call={n}", fused_records[n])
                del got
            if fused_records:
                chosen = fused_records[fused_n]
                f_seconds = chosen["seconds"]
                record.update(native_fused_seconds=f_seconds, native_fused_peak_device_bytes=chosen["peak_device_bytes"],
                              native_fused_windows_per_call=fused_n, native_fused_by_windows_per_call=fused_records,
                              native_fused_working_bytes=chosen["peak_device_bytes"] - resident,
                              native_fused_bitwise_equal_to_diffusers=all(r["bitwise_equal_to_diffusers"] for r in fused_records.values()),
                              native_fused_speedup_vs_reference=round(by_n[best_n]["seconds"] / f_seconds, 4),
                              native_fused_speedup_vs_diffusers=round(d_seconds / f_seconds, 4))
                if "roofline_seconds" in record:
                    record["native_fused_roofline_ratio"] = round(f_seconds / record["roofline_seconds"], 4)
                if profile_kernels:
                    record["native_fused_kernel_profile"] = kernel_profile(partial(fused_by_n[fused_n].decode, z))
                    profile_kernels = False
            print({k: v for k, v in record.items() if k != "by_windows_per_call"})
            records.append(record)
            del z, expected
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {**environment(), "dtype": str(vae.decoder.proj_out.weight.dtype), "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--windows-per-call", type=int, nargs="+", default=[1, 8], help="tile-windows per ViT call; each is timed and checked")
    parser.add_argument("--attention", default="torch-sdpa", help="the native side's attention backend (diffusers always runs its own pick)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="dry run: the demo family's VAE on the CPU at a small canvas")
    parser.add_argument("--canvases", nargs="+", choices=sorted(CANVASES), default=list(CANVASES), help="canvases to decode (not with --small)")
    parser.add_argument("--durations", type=float, nargs="+", default=list(SECONDS), help="clip lengths in seconds")
    parser.add_argument("--profile", action="store_true", help="a CUDA kernel profile of the first canvas and duration's fused decode")
    parser.add_argument("--fused-windows-per-call", type=int, nargs="+", default=None,
                        help="tile-windows per call of the fused decode, each timed and checked (default: the largest --windows-per-call)")
    args = parser.parse_args()
    if args.small:
        device, spec, canvases = torch.device("cpu"), DEMO_FAMILY, SMALL_CANVASES
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --small)")
        device, spec, canvases = torch.device("cuda:0"), family_spec(), {c: CANVASES[c] for c in args.canvases}
    vaes = load_vaes(args.cache, spec, device)
    data = run(vaes, device, canvases, args.windows_per_call, args.attention, args.repeat, tuple(args.durations),
               args.profile and device.type == "cuda", args.fused_windows_per_call)
    data["small"] = args.small
    write_result("vae_small_cpu" if args.small else "vae_h200", data)


if __name__ == "__main__":
    main()
