"""`create_app(config) -> web.Application`: the HTTP layer of `vflash serve`.

The HTTP process owns validation, job records and output names; all model work happens in the worker
processes that `WorkerSupervisor` spawns (one per GPU, GPU pair or CPU worker), started and stopped by the one
`cleanup_ctx` below. With `ServiceConfig.redis_url` it is a fleet front end instead: the same handlers over job
records in Redis (`fleet_front`), run by fleet workers on any number of hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from ..errors import VflashError
from ..fileio import remove_if_owner_ended
from . import metrics
from .config import ServiceConfig
from .jobs import JOB_ID_PATTERN, Job, JobRecords, JobState, JobStore, QueueFullError, new_job_id, redact_paths
from .metrics import Histogram, WorkerSeries
from .submission import InputPolicy, bad_request, http_error, read_submission
from .supervisor import WorkerState, WorkerSupervisor
from .validation import RequestValidator

__all__ = [
    "JOBS", "SUPERVISOR", "WORKERS", "WORK_DIR", "WORK_DIR_OWNER", "WORK_DIR_PREFIX", "ClientFaultLogFilter",
    "WorkerPool", "create_app", "remove_stale_work_dirs",
]

logger = logging.getLogger(__name__)


class WorkerPool(Protocol):
    """What the handlers ask of the workers: this host's `WorkerSupervisor`, or a fleet's `FleetWorkers`."""

    @property
    def state(self) -> WorkerState: ...
    @property
    def fatal_error(self) -> str | None: ...
    @property
    def request_seconds(self) -> Histogram: ...
    def worker_views(self) -> list[dict[str, Any]]: ...
    def worker_series(self) -> list[WorkerSeries]: ...
    def cancel(self, job: Job) -> None: ...


CONFIG = web.AppKey("vflash_config", ServiceConfig)
JOBS = web.AppKey[JobRecords]("vflash_jobs")
WORKERS = web.AppKey[WorkerPool]("vflash_workers")
SUPERVISOR = web.AppKey("vflash_supervisor", WorkerSupervisor)  # this host's workers (not in a fleet front end)
VALIDATOR = web.AppKey("vflash_validator", RequestValidator)
UPLOADS = web.AppKey("vflash_uploads", Path)  # each job's uploads go to a folder of its id in here
WORK_DIR = web.AppKey("vflash_work_dir", Path)

WORK_DIR_PREFIX = ".vflash-work-"
#: Inside each work folder: "<host name> <pid>" of the service that owns it.
WORK_DIR_OWNER = "owner"

# Probes must work without credentials: orchestrators call them unauthenticated.
_OPEN_PATHS = frozenset({"/healthz", "/readyz"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ClientFaultLogFilter(logging.Filter):
    """aiohttp logs a malformed HTTP message (garbage bytes, an oversized header line) or a client that hung up
    with a full traceback; those are the client's faults, so they become one line. Other exceptions keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, ConnectionResetError)):
            detail = (getattr(exc, "message", "") or str(exc) or type(exc).__name__).strip().splitlines()
            record.msg, record.args = "%s: %s", (record.getMessage(), detail[0] if detail else type(exc).__name__)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_CLIENT_FAULTS = ClientFaultLogFilter()


def create_app(config: ServiceConfig) -> web.Application:
    """Build the service; nothing is spawned or written until the app starts."""
    logging.getLogger("aiohttp.server").addFilter(_CLIENT_FAULTS)  # once: a filter is added to a logger only once
    middlewares = [] if config.token is None else [_bearer_auth(config.token)]
    if config.redis_url is not None:
        middlewares.append(_redis_unreachable)
    app = web.Application(middlewares=middlewares)
    app[CONFIG] = config
    app[VALIDATOR] = RequestValidator(config)
    if config.redis_url is None:
        jobs = JobStore(config.max_queue, config.keep_finished_jobs)
        # The hidden work folder (uploads, staging, worker TMPDIRs) shares the output folder's filesystem, so
        # publishing a staged video is an `os.link`.
        work_dir = config.output_dir / f"{WORK_DIR_PREFIX}{secrets.token_hex(4)}"
        app[JOBS] = jobs
        app[WORK_DIR] = work_dir
        app[UPLOADS] = work_dir / "uploads"
        app[WORKERS] = app[SUPERVISOR] = WorkerSupervisor(config, jobs, work_dir)
        app.cleanup_ctx.append(_worker_lifecycle)
    else:
        _fleet_front_end(app, config, config.redis_url)
    app.add_routes([
        web.post("/v1/jobs", submit_job),
        web.get("/v1/jobs/{job_id}", get_job),
        web.get("/v1/jobs/{job_id}/video", get_video),
        web.delete("/v1/jobs/{job_id}", cancel_job),
        web.get("/readyz", readyz),
        web.get("/healthz", healthz),
        web.get("/metrics", get_metrics),
    ])
    return app


async def _worker_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The work folder and the single worker task: created at startup, stopped and removed at shutdown."""
    work_dir = app[WORK_DIR]
    remove_stale_work_dirs(work_dir.parent)
    work_dir.mkdir()
    (work_dir / WORK_DIR_OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    supervisor = app[SUPERVISOR]
    task = asyncio.create_task(supervisor.run(), name="vflash-worker-supervisor")
    task.add_done_callback(lambda done: _supervisor_ended(supervisor, done))
    try:
        yield
    finally:
        if not task.done():  # a task that already ended was reported by `_supervisor_ended`
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        shutil.rmtree(work_dir, ignore_errors=True)


def _fleet_front_end(app: web.Application, config: ServiceConfig, redis_url: str) -> None:
    """Job records in the fleet's Redis, uploads in the shared output folder; no worker of its own."""
    from .fleet_front import FleetJobStore, FleetWorkers, fleet_uploads
    from .fleet_store import connect

    client = connect(redis_url)
    app[JOBS] = FleetJobStore(client, config.output_dir, config.max_queue, config.keep_finished_jobs, config.retries)
    app[WORKERS] = FleetWorkers(client)
    app[UPLOADS] = fleet_uploads(config.output_dir)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        app[UPLOADS].mkdir(parents=True, exist_ok=True)
        yield
        client.close()

    app.cleanup_ctx.append(lifecycle)


@web.middleware
async def _redis_unreachable(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A fleet front end whose Redis does not answer says so (503), in the API's JSON form."""
    import redis

    try:
        return await handler(request)
    except redis.RedisError as exc:
        logger.error("the fleet's Redis failed: %s", exc)
        raise http_error(web.HTTPServiceUnavailable, f"the job store (Redis) is unavailable: {exc}") from None


def remove_stale_work_dirs(output_dir: Path) -> list[Path]:
    """Remove the work folders (uploads, staged videos) of services on this host that ended without cleaning up.

    A folder is stale when its owner file names this host and a process id that no longer exists; folders of live
    services, of other hosts sharing the output folder, or without an owner file are left alone.
    """
    owned = []
    for folder in output_dir.glob(f"{WORK_DIR_PREFIX}*"):
        try:
            owner_host, pid = (folder / WORK_DIR_OWNER).read_text().split()
        except (OSError, ValueError):
            continue
        owned.append((folder, owner_host, pid))
    return remove_if_owner_ended(owned, "service process")


def _supervisor_ended(supervisor: WorkerSupervisor, task: asyncio.Task[None]) -> None:
    """A supervisor that crashed is a bug; make it visible in the log and in /readyz instead of hanging the queue."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    logger.error("the worker supervisor crashed", exc_info=exc)
    supervisor.go_fatal(f"internal error in the worker supervisor: {type(exc).__name__}: {exc}")


def _bearer_auth(token: str) -> Any:
    expected = token.encode()

    @web.middleware
    async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes; they go back to the same bytes,
            # which match no token. The scheme is case-insensitive (RFC 9110 section 11.1), the token is not.
            header = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            scheme, _, given = header.strip().partition(b" ")
            # constant time over the token: no prefix of it leaks through timing
            if not hmac.compare_digest(given.strip(), expected) or scheme.lower() != b"bearer":
                raise http_error(
                    web.HTTPUnauthorized, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"}
                )
        return await handler(request)

    return bearer_auth


# -- jobs ---------------------------------------------------------------------------------------------------------


async def submit_job(request: web.Request) -> web.Response:
    app = request.app
    _check_accepting(app)
    job_id = new_job_id()
    upload_dir = app[UPLOADS] / job_id
    try:
        job = await _accept(request, job_id, upload_dir)
    except BaseException:
        shutil.rmtree(upload_dir, ignore_errors=True)  # a rejected submission leaves nothing behind
        raise
    logger.info("job %s queued at position %s", job.id, app[JOBS].queue_position(job))
    url = f"/v1/jobs/{job.id}"
    return web.json_response(
        {"id": job.id, "status": job.state.value, "url": url}, status=202, headers={"Location": url}
    )


async def _accept(request: web.Request, job_id: str, upload_dir: Path) -> Job:
    app = request.app
    config = app[CONFIG]
    fields = await read_submission(request, upload_dir, InputPolicy(config.input_dir, config.max_upload_bytes))
    try:
        video_request = await asyncio.to_thread(app[VALIDATOR], fields)
    except VflashError as exc:
        raise bad_request(redact_paths(str(exc), (upload_dir, config.input_dir))) from None
    job = Job(job_id, video_request, upload_dir if upload_dir.exists() else None)
    _check_accepting(app)  # the worker may have failed, or the queue filled, while this request was validated
    app[JOBS].add(job)
    return job


def _check_accepting(app: web.Application) -> None:
    supervisor = app[WORKERS]
    if supervisor.state in (WorkerState.FATAL, WorkerState.STOPPED):
        reason = supervisor.fatal_error or "the service is stopping"
        raise http_error(web.HTTPServiceUnavailable, f"the service cannot run jobs: {reason}")
    try:
        app[JOBS].check_capacity()
    except QueueFullError as exc:
        raise http_error(web.HTTPTooManyRequests, str(exc)) from None


def _job(request: web.Request) -> Job:
    job_id = request.match_info["job_id"]
    job = request.app[JOBS].get(job_id) if JOB_ID_PATTERN.fullmatch(job_id) else None
    if job is None:
        raise http_error(web.HTTPNotFound, f"no job {job_id!r}")
    return job


async def get_job(request: web.Request) -> web.Response:
    job = _job(request)
    return web.json_response(job.view(request.app[JOBS].queue_position(job)))


async def get_video(request: web.Request) -> web.StreamResponse:
    job = _job(request)
    if job.state is not JobState.SUCCEEDED:
        detail = f": {job.error}" if job.error else ""
        raise http_error(web.HTTPConflict, f"job {job.id} is {job.state.value}{detail}; it has no video")
    assert job.output is not None
    return web.FileResponse(job.output, headers={
        "Content-Type": "video/mp4", "Content-Disposition": f'attachment; filename="{job.output.name}"',
    })


async def cancel_job(request: web.Request) -> web.Response:
    """Queued jobs are cancelled at once (200); a running job stops within one evaluation (202, then poll)."""
    job = _job(request)
    if job.state.terminal:
        raise http_error(web.HTTPConflict, f"job {job.id} is already {job.state.value}")
    request.app[WORKERS].cancel(job)
    status = 200 if job.state.terminal else 202
    return web.json_response(job.view(request.app[JOBS].queue_position(job)), status=status)


# -- service ------------------------------------------------------------------------------------------------------


async def readyz(request: web.Request) -> web.Response:
    """Ready once a worker passed its profile and device checks (not "the model is loaded": loading happens on its
    first job); `workers` reports each worker slot."""
    supervisor = request.app[WORKERS]
    ready = supervisor.state is WorkerState.READY
    body = {
        "ready": ready, "worker": supervisor.state.value, "workers": supervisor.worker_views(),
        "error": supervisor.fatal_error,
    }
    return web.json_response(body, status=200 if ready else 503)


async def healthz(request: web.Request) -> web.Response:
    """Liveness of the HTTP process only; a restarting worker does not make the service unhealthy."""
    return web.json_response({"ok": True})


async def get_metrics(request: web.Request) -> web.Response:
    supervisor = request.app[WORKERS]
    jobs = request.app[JOBS]
    text = metrics.render(
        {state.value: count for state, count in jobs.counts().items()}, supervisor.request_seconds,
        supervisor.worker_series(), supervisor.state is WorkerState.READY, jobs.max_queue,
    )
    return web.Response(body=text.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})
