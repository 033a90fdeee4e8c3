"""`vflash serve`: the HTTP generation service (see `vflash_core.service`)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from pathlib import Path

from ..errors import Number, RunFailedError, VflashError
from ..fileio import MIB

__all__ = ["COMMANDS", "is_loopback", "register"]

COMMANDS = {"serve": "HTTP generation service: jobs, readiness, cancel, one spawned worker per GPU"}

PORT = Number(int, 0, 65535)
#: --max-upload-mb: positive, and at most 1 TiB, so its byte count is an integer.
UPLOAD_MIB = Number(float, 0, 2**20, above=True, unit="MiB")

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    from ..pipeline.options import RunOptions
    from ..service.config import CANCEL_GRACE, KEEP_FINISHED_JOBS, MAX_QUEUE, RETRIES, TORCH_THREADS, WORKERS

    p = sub.add_parser("serve", help=COMMANDS["serve"])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prepared-assets", type=Path, help="prepared-assets receipt (JSON) of the model to serve")
    source.add_argument("--demo", action="store_true", help="serve the embedded default model (tiny, CPU)")
    RunOptions.add_arguments(p)  # the same run options as `vflash generate`
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; anything else wants --token)")
    p.add_argument(
        "--port", type=PORT.option("--port"), default=8000, help="TCP port (default 8000; 0 picks a free one)"
    )
    p.add_argument(
        "--output-dir", type=Path, required=True, help="where finished videos are published (created if missing)"
    )
    p.add_argument("--input-dir", type=Path, help="allow request inputs given as paths inside this folder")
    p.add_argument(
        "--max-queue", type=MAX_QUEUE.option("--max-queue"), default=16, help="queued jobs before 429 (default 16)"
    )
    p.add_argument(
        "--keep-finished-jobs", type=KEEP_FINISHED_JOBS.option("--keep-finished-jobs"), default=1000,
        help="records of ended jobs kept for status queries; the oldest are forgotten beyond this (default 1000)"
    )
    p.add_argument(
        "--max-upload-mb", type=UPLOAD_MIB.option("--max-upload-mb"), default=64.0,
        help="uploaded bytes per job, in MiB (default 64)"
    )
    p.add_argument("--token", default=os.environ.get("VFLASH_SERVICE_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $VFLASH_SERVICE_TOKEN; prefer it to the flag, "
                        "which other local users can read in the process list)")
    p.add_argument("--cancel-grace", type=CANCEL_GRACE.option("--cancel-grace"), default=10.0,
                   help="seconds a cancelled job's worker may take before it is killed (default 10)")
    p.add_argument("--gpus", type=parse_gpus, metavar="LIST",
                   help="one worker per GPU, e.g. 0,1,2,3; or per pair for --strategy, e.g. 0+1,2+3 (instead of "
                        "--gpu and --peer-gpu)")
    p.add_argument("--workers", type=WORKERS.option("--workers"), default=1,
                   help="worker processes on the CPU (default 1; on GPUs, --gpus gives one per GPU)")
    p.add_argument("--worker-threads", type=TORCH_THREADS.option("--worker-threads"),
                   help="torch threads of each worker (default: torch's own, every core)")
    p.add_argument("--no-pipeline", dest="pipelined", action="store_false",
                   help="run each worker's jobs strictly one after another (default: the next job's encode and "
                        "denoise start while the last one's MP4 is written, where the memory plan says both fit)")
    p.add_argument("--redis", metavar="URL",
                   help="a fleet front end: jobs in this Redis (e.g. redis://queue-host:6379/0), run by `vflash "
                        "fleet-worker`s sharing --output-dir; this process starts no worker")
    p.add_argument("--retries", type=RETRIES.option("--retries"), default=1,
                   help="with --redis: runs of a job after the first whose fleet worker was lost, before it fails "
                        "(default 1)")
    p.set_defaults(handler=_serve)


def parse_gpus(text: str) -> tuple[tuple[int, ...], ...]:
    """`0,1,2,3` -> ((0,), (1,), (2,), (3,)); `0+1,2+3` -> ((0, 1), (2, 3))."""
    try:
        return tuple(tuple(int(index) for index in entry.split("+")) for entry in text.split(","))
    except ValueError:
        raise VflashError(
            f"--gpus takes CUDA indices separated by commas, pairs joined by '+' (0,1 or 0+1,2+3), got {text!r}"
        ) from None


def _gpu_options(args: argparse.Namespace) -> None:
    """`--gpus` stands for --gpu and --peer-gpu (their first entry builds the shared run options); refused at once
    on a machine without CUDA GPUs, which the HTTP process asks without initialising CUDA."""
    import torch

    if args.gpu is not None or args.peer_gpu is not None:
        raise VflashError("--gpus replaces --gpu and --peer-gpu: give one or the other")
    if args.workers != 1:
        raise VflashError("--gpus runs one worker per GPU (or pair); --workers is for the CPU")
    count = torch.cuda.device_count()
    if count == 0:
        raise VflashError("--gpus needs CUDA GPUs and this machine has none; on the CPU, use --workers N")
    missing = sorted({index for entry in args.gpus for index in entry if index >= count})
    if missing:
        raise VflashError(f"--gpus names GPU {missing[0]}, but this machine has {count} (0 to {count - 1})")
    if len(args.gpus[0]) == 2 and args.strategy is None:
        raise VflashError("--gpus with pairs needs --strategy (sequence-head or tensor)")
    args.gpu = args.gpus[0][0]
    args.peer_gpu = args.gpus[0][1] if len(args.gpus[0]) == 2 else None


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from ..pipeline.assets import PreparedAssets
    from ..pipeline.options import RunOptions
    from ..service import ServiceConfig, create_app
    from ..service.config import check_service_settings, check_workers

    if args.redis is not None and (args.gpus is not None or args.gpu is not None or args.workers != 1):
        raise VflashError("a fleet front end (--redis) runs no worker: start one `vflash fleet-worker` per GPU instead "
                          "of --gpu, --gpus or --workers")
    if args.gpus is not None:
        _gpu_options(args)
    if args.peer_gpu is not None and args.gpu is None:
        raise VflashError("--peer-gpu needs --gpu")
    if args.max_upload_mb * MIB < 1:
        raise VflashError(f"--max-upload-mb {args.max_upload_mb:g} is less than one byte")
    settings = dict(
        output_dir=args.output_dir, create_output_dir=True, input_dir=args.input_dir, max_queue=args.max_queue,
        keep_finished_jobs=args.keep_finished_jobs, max_upload_bytes=int(args.max_upload_mb * MIB), token=args.token,
        cancel_grace_seconds=args.cancel_grace,
    )
    fleet = dict(redis_url=args.redis, retries=args.retries)
    workers = dict(gpus=args.gpus or (), workers=args.workers, pipelined=args.pipelined,
                   torch_threads=args.worker_threads)
    options = RunOptions.from_arguments(args)
    check_service_settings(**settings)  # everything but the model, before the demo model is built
    check_workers(options, workers["gpus"], args.workers, args.worker_threads)
    check_bindable(args.host, args.port)
    if args.demo:
        from ..pipeline.demo import ensure_demo_assets

        prepared = ensure_demo_assets()
    else:
        prepared = args.prepared_assets
    PreparedAssets.load(prepared)  # a malformed receipt is refused before the output folder is created
    config = ServiceConfig(
        prepared_assets=prepared, options=options, log_level=logging.getLogger().level, **settings, **workers,
        **fleet,
    )
    if not is_loopback(args.host) and config.token is None:
        logger.warning("serving on %s without a token: anyone who can reach this address can submit jobs; "
                       "set VFLASH_SERVICE_TOKEN (or --token), or bind 127.0.0.1", args.host)
    app = create_app(config)
    try:
        web.run_app(app, host=args.host, port=args.port, access_log=logging.getLogger("vflash.access"))
    except OSError as exc:  # the address cannot be bound: in use, not this machine's, not resolvable
        raise RunFailedError(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0


def check_bindable(host: str, port: int) -> None:
    """Bind the address once and release it, so that a port in use or a host that is not this machine's is refused
    before the demo model is built or the output folder created."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind(address)
    except OSError as exc:  # socket.gaierror included: a host that does not resolve
        raise RunFailedError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
