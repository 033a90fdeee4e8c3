"""`vflash denoise`: a conditioning bundle through the native core to latents (the compiler has its own module CLI,
`python -m vflash_core.weights.compiler prepare|compile`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from ..errors import VflashError

__all__ = ["COMMANDS", "register"]

COMMANDS = {"denoise": "run the native core on a conditioning bundle and write latents"}


def register(sub: argparse._SubParsersAction) -> None:
    from ..engine.engine_options import EngineOptions

    p = sub.add_parser("denoise", help=COMMANDS["denoise"])
    p.add_argument("profile", help="profile id, e.g. t2va-base16-bf16-sm90")
    p.add_argument("--artifact", required=True, help="compiled artifact/ folder")
    p.add_argument("--schedule-overlay", required=True, help="compiled schedule/ folder")
    p.add_argument("--auxiliary-tensor", required=True, help="compiled auxiliary.safetensors")
    p.add_argument("--bundle", required=True, help="conditioning bundle folder")
    p.add_argument("--output-latents", required=True, help="output .safetensors (must not exist)")
    EngineOptions.add_arguments(p)  # the engine's flags, as `vflash generate` has them
    p.add_argument("--profile-denoise", action="store_true",
                   help="per-evaluation, per-stage device timings in the report")
    p.set_defaults(handler=_denoise)


def _denoise(args: argparse.Namespace) -> int:
    from ..engine.artifact import CompiledPaths
    from ..engine.bundle import ConditioningBundle
    from ..engine.engine_options import EngineOptions
    from ..engine.session import NativeEngineSession
    from ..engine.session_hooks import SessionHooks
    from ..fileio import check_writable_destination
    from ..formats import check_device
    from ..profiles import get_profile
    from .generate import StageBars

    check_writable_destination(args.output_latents)
    if os.path.lexists(args.bundle) and not os.path.isdir(args.bundle):
        raise VflashError(f"--bundle {args.bundle} is not a folder; give the conditioning bundle's folder")
    profile = get_profile(args.profile)
    options = EngineOptions.from_arguments(args)
    for role, device in zip(("device", *["peer device"] * len(options.peers)), options.devices_named):
        check_device(device, profile.arch, role, profile.id)
    paths = CompiledPaths(args.artifact, args.schedule_overlay, args.auxiliary_tensor)
    bundle = ConditioningBundle.load(args.bundle)
    with contextlib.closing(StageBars()) as bars:
        hooks = SessionHooks(on_load_progress=lambda done, total: bars("load weights", done, total))
        with NativeEngineSession(profile, paths, options, hooks=hooks) as session:
            session.validate(bundle)
            result = session.generate(bundle, progress=lambda done, total: bars("denoise", done, total),
                                      output_latents=args.output_latents, profile_denoise=args.profile_denoise)
    print(f"wrote {args.output_latents}")
    report = {"timing": result.timing.__dict__, "metadata": result.metadata}
    if result.denoise_profile is not None:
        report["denoise_profile"] = result.denoise_profile
    print(json.dumps(report, indent=2))
    return 0
