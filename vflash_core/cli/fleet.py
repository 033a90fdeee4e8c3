"""`vflash fleet-worker`: one worker of a Redis-backed fleet (see `vflash_core.service.fleet_worker`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from ..errors import Number, RunFailedError

__all__ = ["COMMANDS", "register"]

COMMANDS = {"fleet-worker": "one worker of a fleet: runs jobs of a `vflash serve --redis` front end on one GPU"}

#: The heartbeat's time to live: a worker silent this long is lost and its jobs run again elsewhere.
HEARTBEAT = Number(float, 0.5, 3600, unit="seconds")


def register(sub: argparse._SubParsersAction) -> None:
    from ..pipeline.options import RunOptions
    from ..service.config import CANCEL_GRACE, TORCH_THREADS

    p = sub.add_parser("fleet-worker", help=COMMANDS["fleet-worker"])
    p.add_argument("--redis", required=True, metavar="URL", help="the fleet's Redis, e.g. redis://queue-host:6379/0")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prepared-assets", type=Path, help="prepared-assets receipt (JSON) of the served model")
    source.add_argument("--demo", action="store_true", help="the embedded default model (tiny, CPU)")
    RunOptions.add_arguments(p)  # --gpu N (and --peer-gpu with --strategy): this worker's devices
    p.add_argument("--output-dir", type=Path, required=True,
                   help="the fleet's shared output folder, mounted at the same path on every host")
    p.add_argument("--worker-threads", type=TORCH_THREADS.option("--worker-threads"),
                   help="torch threads of the worker (default: torch's own, every core)")
    p.add_argument("--no-pipeline", dest="pipelined", action="store_false",
                   help="run jobs strictly one after another (default: the next job starts during a write)")
    p.add_argument("--cancel-grace", type=CANCEL_GRACE.option("--cancel-grace"), default=10.0,
                   help="seconds a cancelled job's worker may take before it is killed (default 10)")
    p.add_argument("--heartbeat", type=HEARTBEAT.option("--heartbeat"), default=10.0,
                   help="seconds of silence after which this worker counts as lost and its jobs are run again "
                        "elsewhere (default 10)")
    p.set_defaults(handler=_fleet_worker)


def _fleet_worker(args: argparse.Namespace) -> int:
    from ..pipeline.h3_pipeline import PreparedAssets
    from ..pipeline.options import RunOptions
    from ..service.config import ServiceConfig
    from ..service.fleet_worker import run_fleet_worker

    if args.demo:
        from ..pipeline.demo import ensure_demo_assets

        prepared = ensure_demo_assets()
    else:
        prepared = args.prepared_assets
    PreparedAssets.load(prepared)
    config = ServiceConfig(
        prepared_assets=prepared, output_dir=args.output_dir, options=RunOptions.from_arguments(args),
        pipelined=args.pipelined, torch_threads=args.worker_threads, cancel_grace_seconds=args.cancel_grace,
        log_level=logging.getLogger().level,
    )
    reason = asyncio.run(run_fleet_worker(config, args.redis, args.heartbeat))
    if reason is not None:
        raise RunFailedError(f"this fleet worker cannot run jobs: {reason}")
    return 0
