"""`vflash compare`: one request rendered exactly and with a named fast mode, measured (`pipeline.compare`)."""

from __future__ import annotations

import argparse
import contextlib

from ..errors import VflashError
from .generate import StageBars, add_request_arguments, request_from_arguments

__all__ = ["COMMANDS", "register"]

COMMANDS = {
    "compare": "render one request exactly and with a fast mode: per-frame PSNR / SSIM, audio spectral distance, "
               "times, both MP4s and a side-by-side MP4",
}


def register(sub: argparse._SubParsersAction) -> None:
    from ..pipeline.options import RunOptions

    p = sub.add_parser("compare", help=COMMANDS["compare"])
    add_request_arguments(p)
    RunOptions.add_arguments(p)  # --fast-mode names the side compared with the exact one (required here)
    p.add_argument("--output-dir", required=True,
                   help="folder for exact.mp4, fast.mp4, side_by_side.mp4 and comparison.json (created if missing)")
    p.add_argument("--overwrite", action="store_true", help="replace existing files of a comparison there")
    p.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace) -> int:
    from ..pipeline.assets import ASSET_FIELDS, PreparedAssets
    from ..pipeline.compare import OUTPUT_NAMES, compare, summary_lines
    from ..pipeline.h3_pipeline import H3Pipeline
    from ..pipeline.options import RunOptions
    from ..pipeline.validation import check_output_is_not_an_input

    options = RunOptions.from_arguments(args)
    if options.fast_mode.exact:
        raise VflashError("vflash compare needs --fast-mode (e.g. sparse-attention or step-cache), not exact")
    request = request_from_arguments(args)
    assets = PreparedAssets.load(args.prepared_assets)
    inputs = {
        "--prompt-file": args.prompt_file, "prepared-assets receipt": assets.path,
        **{name: getattr(assets, name) for name in ASSET_FIELDS},
    }
    for name in OUTPUT_NAMES.values():
        check_output_is_not_an_input(f"{args.output_dir}/{name}", inputs)
    with H3Pipeline.from_prepared(assets, options) as pipeline, contextlib.closing(StageBars()) as bars:
        result = compare(pipeline, request, args.output_dir, overwrite=args.overwrite, progress=bars)
    print("\n".join(summary_lines(result.report)))
    print(f"wrote {result.exact_path}, {result.fast_path}, {result.side_by_side_path}")
    print(f"report: {result.report_path}")
    return 0
