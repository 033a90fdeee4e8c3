"""`vflash denoise`: a conditioning bundle through the native core to latents (the compiler has its own module CLI,
`python -m vflash_core.weights.compiler prepare|compile`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from ..engine.fast_mode import FastMode
from ..errors import VflashError

__all__ = ["COMMANDS", "register"]

COMMANDS = {"denoise": "run the native core on a conditioning bundle and write latents"}


def register(sub: argparse._SubParsersAction) -> None:
    from ..engine.attention_backends import BACKENDS
    from ..engine.session_options import STRATEGIES, WEIGHT_RESIDENCIES
    from ..formats import GPU_INDEX
    from ..memory_plan import DEVICE_MEMORY_GIB

    p = sub.add_parser("denoise", help=COMMANDS["denoise"])
    p.add_argument("profile", help="profile id, e.g. t2va-base16-bf16-sm90")
    p.add_argument("--artifact", required=True, help="compiled artifact/ folder")
    p.add_argument("--schedule-overlay", required=True, help="compiled schedule/ folder")
    p.add_argument("--auxiliary-tensor", required=True, help="compiled auxiliary.safetensors")
    p.add_argument("--bundle", required=True, help="conditioning bundle folder")
    p.add_argument("--output-latents", required=True, help="output .safetensors (must not exist)")
    p.add_argument("--gpu", type=GPU_INDEX.option("--gpu"), help="CUDA device index (default: CPU)")
    p.add_argument("--peer-gpu", type=GPU_INDEX.option("--peer-gpu"), action="append",
                   help="another GPU for this request (repeatable); needs --strategy")
    p.add_argument("--strategy", choices=STRATEGIES, help="how several GPUs split one request")
    p.add_argument("--weight-residency", choices=WEIGHT_RESIDENCIES, default="auto",
                   help="the blocks all on the device, streamed from pinned host memory (block-ring) or from their "
                        "compiled files (disk-ring, one GPU); auto: the memory plan chooses")
    p.add_argument("--max-device-memory", type=DEVICE_MEMORY_GIB.option("--max-device-memory"), metavar="GIB",
                   help="cap on the device memory the session may use, in GiB (default: what the GPU has free); "
                        "planned against and enforced")
    p.add_argument("--max-host-memory", type=DEVICE_MEMORY_GIB.option("--max-host-memory"), metavar="GIB",
                   help="budget for the host memory the session's blocks may hold, in GiB, with a margin for the "
                        "process (default: not planned); where the pinned blocks do not fit, they stream from their "
                        "compiled files (disk-ring)")
    p.add_argument("--attention-backend", default="auto", help=f"attention kernel: {', '.join(BACKENDS)}")
    p.add_argument("--profile-denoise", action="store_true",
                   help="per-evaluation, per-stage device timings in the report")
    FastMode.add_arguments(p)
    p.set_defaults(handler=_denoise)


def _denoise(args: argparse.Namespace) -> int:
    from ..engine.bundle import ConditioningBundle
    from ..engine.session import NativeEngineSession
    from ..fileio import check_writable_destination
    from ..formats import check_device, gpu_device
    from ..profiles import get_profile
    from .generate import StageBars

    check_writable_destination(args.output_latents)
    if os.path.lexists(args.bundle) and not os.path.isdir(args.bundle):
        raise VflashError(f"--bundle {args.bundle} is not a folder; give the conditioning bundle's folder")
    profile = get_profile(args.profile)
    device = check_device(gpu_device(args.gpu), profile.arch, profile_id=profile.id)
    for peer in args.peer_gpu or ():
        check_device(peer, profile.arch, "peer device", profile.id)
    bundle = ConditioningBundle.load(args.bundle)
    with contextlib.closing(StageBars()) as bars:
        session = NativeEngineSession(
            args.profile, args.artifact, args.schedule_overlay, args.auxiliary_tensor,
            device=device, peer_device=args.peer_gpu, strategy=args.strategy,
            weight_residency=args.weight_residency, attention_backend=args.attention_backend,
            max_device_memory=args.max_device_memory, max_host_memory=args.max_host_memory,
            on_load_progress=lambda done, total: bars("load weights", done, total),
            fast_mode=FastMode.from_arguments(args),
        )
        with session:
            session.validate(bundle)
            result = session.generate(bundle, progress=lambda done, total: bars("denoise", done, total),
                                      output_latents=args.output_latents, profile_denoise=args.profile_denoise)
    print(f"wrote {args.output_latents}")
    report = {"session": result.session.__dict__, "metadata": result.metadata}
    if result.denoise_profile is not None:
        report["denoise_profile"] = result.denoise_profile
    print(json.dumps(report, indent=2))
    return 0
