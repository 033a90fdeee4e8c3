"""`vflash denoise` (bundle -> latents through the native core) and `vflash prepare` / `vflash compile`."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("denoise", help="run the native core on a conditioning bundle and write latents")
    p.add_argument("profile", help="profile id, e.g. t2va-base16-bf16-sm90")
    p.add_argument("--artifact", required=True, help="compiled artifact/ folder")
    p.add_argument("--schedule-overlay", required=True, help="compiled schedule/ folder")
    p.add_argument("--auxiliary-tensor", required=True, help="compiled auxiliary.safetensors")
    p.add_argument("--bundle", required=True, help="conditioning bundle folder")
    p.add_argument("--output-latents", required=True, help="output .safetensors (must not exist)")
    p.add_argument("--gpu", type=int, help="CUDA device index (default: CPU)")
    p.add_argument("--attention-backend", default="auto")
    p.set_defaults(handler=_denoise)

    p = sub.add_parser("prepare", help="bind a profile to official weights (same as python -m vflash_core.compiler prepare)")
    p.add_argument("--profile", required=True)
    p.add_argument("--transformer", required=True)
    p.add_argument("--adapter")
    p.add_argument("--qkv-layout", choices=("stacked", "interleaved"))
    p.add_argument("--receipt", required=True)
    p.set_defaults(handler=_prepare)

    p = sub.add_parser("compile", help="compile a receipt (same as python -m vflash_core.compiler compile)")
    p.add_argument("--receipt", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--gpu", type=int, help="CUDA device index (default: CPU)")
    p.set_defaults(handler=_compile)


def _denoise(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bundle import ConditioningBundle
    from .fileio import check_writable_destination
    from .session import NativeEngineSession

    check_writable_destination(args.output_latents)
    bundle = ConditioningBundle.load(args.bundle)
    device = "cpu" if args.gpu is None else f"cuda:{args.gpu}"
    with tqdm(desc="load weights", unit="block") as load_bar:
        def on_load(done: int, total: int) -> None:
            load_bar.total = total
            load_bar.update(1)

        session = NativeEngineSession(
            args.profile, args.artifact, args.schedule_overlay, args.auxiliary_tensor, device=device,
            attention_backend=args.attention_backend, on_load_progress=on_load,
        )
    with session, tqdm(total=session.profile.nfe, desc="denoise", unit="eval") as bar:
        session.validate(bundle)
        result = session.generate(bundle, progress=lambda done, total: bar.update(1), output_latents=args.output_latents)
    print(f"wrote {args.output_latents}")
    print(json.dumps({"session": result.session.__dict__, "metadata": result.metadata}, indent=2))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from .compiler import prepare

    prepare(args.profile, args.transformer, args.receipt, args.adapter, args.qkv_layout)
    print(f"wrote receipt {args.receipt}")
    return 0


def _compile(args: argparse.Namespace) -> int:
    from .compiler import compile_receipt

    out = compile_receipt(args.receipt, args.output, "cpu" if args.gpu is None else f"cuda:{args.gpu}")
    print(f"compiled into {out}: artifact/, schedule/, auxiliary.safetensors")
    return 0
