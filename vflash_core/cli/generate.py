"""`vflash prepare-pipeline`, `vflash generate` (prompt -> MP4) and `vflash demo` (the embedded default model)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..pipeline.validation import VideoRequest

__all__ = ["COMMANDS", "add_request_arguments", "register", "request_from_arguments"]

COMMANDS = {
    "prepare-pipeline": "bind a profile to its six assets (model root, decoders, adapter, compile outputs)",
    "generate": "generate an MP4 (video + soundtrack) from a prompt and optional images",
    "demo": "generate a clip with the embedded random-weight model (no download; noise-like output)",
}

#: stage -> (bar label, unit): the pipeline's stages (`H3Pipeline.generate`'s progress), the core's (`vflash denoise`).
_BARS = {
    "build family": ("build demo family", "step"), "load": ("load models", "part"), "encode": ("encode", "stage"),
    "denoise": ("denoise", "eval"), "decode": ("decode", "stream"), "write": ("write mp4", "file"),
    "load weights": ("load weights", "block"),
}


class StageBars:
    """A `progress(stage, done, total)` callback drawing one tqdm bar per stage on the terminal."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.bar: Any = None  # the running stage's tqdm bar

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm.auto import tqdm

        if stage != self.stage:
            self.close()
            label, unit = _BARS.get(stage, (stage, "it"))
            self.stage, self.bar = stage, tqdm(total=total, desc=label, unit=unit, leave=True)
        self.bar.total = total
        self.bar.update(done - self.bar.n)
        if done >= total:  # close at once, so the bar's time is this stage's alone
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.stage = self.bar = None


def register(sub: argparse._SubParsersAction) -> None:
    from ..pipeline.options import RunOptions

    p = sub.add_parser("prepare-pipeline", help=COMMANDS["prepare-pipeline"])
    p.add_argument("--profile", required=True, help="profile id, e.g. t2va-base16-bf16-sm90")
    p.add_argument(
        "--assets", required=True,
        help="JSON with model_root, decoder_root, adapter_path (or null), artifact, schedule_overlay, auxiliary_tensor"
    )
    p.add_argument("--receipt", required=True, help="prepared-assets receipt to write (must not exist)")
    p.set_defaults(handler=_prepare_pipeline)

    p = sub.add_parser("generate", help=COMMANDS["generate"])
    add_request_arguments(p)
    RunOptions.add_arguments(p)
    p.add_argument("--output", required=True, help="MP4 to write (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument(
        "--profile-denoise", action="store_true",
        help="record per-evaluation device timings (diagnostic; slows the run)"
    )
    p.set_defaults(handler=_generate)

    p = sub.add_parser("demo", help=COMMANDS["demo"])
    p.add_argument("--output", help="MP4 to write (default: demo.mp4, or the next free demo-N.mp4)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument(
        "--cache-dir", type=Path,
        help="where the demo model family is built once (default $VFLASH_CACHE or ~/.cache/vflash)"
    )
    p.set_defaults(handler=_demo)


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """The receipt and the request's flags (`vflash generate`, `vflash compare`); `request_from_arguments` reads
    them."""
    from ..pipeline.request_numbers import PIXELS, SECONDS, SEED

    p.add_argument("--prepared-assets", required=True, help="receipt written by `vflash prepare-pipeline`")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", help="what happens and what it sounds like; <Picture N>, <Video K>, <Audio J> name references"
    )
    prompt.add_argument("--prompt-file", type=Path, help="UTF-8 text file holding the prompt")
    p.add_argument("--first-frame", help="image the video starts from (i2va; with --last-frame fl2va)")
    p.add_argument("--last-frame", help="image the video ends on (l2va; with --first-frame fl2va)")
    p.add_argument(
        "--reference", action="append", default=[], help="ref2va image, video or audio file; repeat, in label order"
    )
    p.add_argument("--duration", type=SECONDS.option("--duration"), default=5.0,
                   help="seconds (5-15, snapped to 17n+5 frames at 24 fps; the profile may allow less)")
    p.add_argument(
        "--width", type=PIXELS.option("--width"), help="multiple of 32 (with --height; default: the model's canvas)"
    )
    p.add_argument("--height", type=PIXELS.option("--height"), help="multiple of 32 (with --width)")
    p.add_argument(
        "--seed", type=SEED.option("--seed"), default=0,
        help="seed of the noise, 0 to 2**63 - 1 (default 0): the same seed gives the same clip"
    )


def _print_result(result, initialization: float, extra: dict | None = None) -> None:
    print(
        f"wrote {result.path}: {result.num_frames} frames {result.width}x{result.height} "
        f"at {result.fps} fps, {result.mode}, {result.sample_rate} Hz stereo AAC"
    )
    for name, seconds in (extra or {}).items():
        print(f"  {name:<16} {seconds:8.2f} s")
    print(f"  {'initialization':<16} {initialization:8.2f} s  (loading the models; not part of the request)")
    for name, seconds in result.stages.items():
        indent = "    " if "." in name else "  "
        print(f"{indent}{name:<{18 - len(indent)}} {seconds:8.2f} s")
    print(f"  {'request total':<16} {result.elapsed_seconds:8.2f} s")
    if "fast_mode" in result.metadata:
        from ..engine.fast_mode_run import describe_fast_mode

        print(f"  {describe_fast_mode(result.metadata['fast_mode'])}")


def _prepare_pipeline(args: argparse.Namespace) -> int:
    from ..pipeline.assets import prepare_pipeline

    assets = prepare_pipeline(args.profile, args.assets, args.receipt)
    print(f"wrote {args.receipt}: profile {assets.profile.id}, compile {assets.record['compile_id']}")
    return 0


def request_from_arguments(args: argparse.Namespace) -> VideoRequest:
    """The `VideoRequest` of `add_request_arguments`' flags (a --prompt-file read now)."""
    from ..fileio import read_text_file
    from ..pipeline.validation import MAX_PROMPT_BYTES, VideoRequest

    if args.prompt_file is not None:
        prompt = read_text_file(args.prompt_file, "--prompt-file", MAX_PROMPT_BYTES).strip()
    else:
        prompt = args.prompt
    return VideoRequest(
        prompt=prompt, first_frame=args.first_frame, last_frame=args.last_frame, references=tuple(args.reference),
        duration_seconds=args.duration, seed=args.seed, width=args.width, height=args.height,
    )


def _generate(args: argparse.Namespace) -> int:
    from ..pipeline.assets import ASSET_FIELDS, PreparedAssets
    from ..pipeline.h3_pipeline import H3Pipeline
    from ..pipeline.options import RunOptions
    from ..pipeline.validation import check_output_is_not_an_input

    request = request_from_arguments(args)
    assets = PreparedAssets.load(args.prepared_assets)
    check_output_is_not_an_input(args.output, {
        "--prompt-file": args.prompt_file, "prepared-assets receipt": assets.path,
        **{name: getattr(assets, name) for name in ASSET_FIELDS},
    })
    pipeline = H3Pipeline.from_prepared(assets, RunOptions.from_arguments(args, profile_denoise=args.profile_denoise))
    with pipeline:
        with contextlib.closing(StageBars()) as bars:
            result = pipeline.generate(request, args.output, overwrite=args.overwrite, progress=bars)
        _print_result(result, pipeline.initialization_seconds)
    if args.profile_denoise:
        print(json.dumps({"denoise_profile": result.metadata.get("denoise_profile")}, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ..pipeline.demo import run_demo

    with contextlib.closing(StageBars()) as bars:
        result, info = run_demo(args.output, overwrite=args.overwrite, cache_dir=args.cache_dir, progress=bars)
    _print_result(
        result, info["initialization_seconds"],
        {"build family" if info["built"] else "find family": info["build_seconds"]}
    )
    print(f"model family: {Path(info['receipt']).parent}")
    print(
        "note: the embedded model has random weights, so the clip is noise-like by design; "
        "it exercises the real code path."
    )
    sys.stdout.flush()
    return 0
