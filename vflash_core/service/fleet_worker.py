"""`vflash fleet-worker`: one worker of a fleet, on one GPU (or pair, or the CPU) of any host.

It is `vflash serve`'s own worker slot: the same `WorkerSupervisor` with one slot, the same spawned worker process
and pipeline, the same staging and `os.link` publication into the output folder (here a folder every host mounts at
the same path). Only the queue differs: `FleetQueue` claims the oldest job of the fleet's Redis queue atomically
(`BLMOVE` onto this worker's processing list), and each claimed job (`FleetJob`) writes its start, progress and end
through to its record. The end is the ack: it removes the claim in the same script that writes the record.

Beside the slot runs the heartbeat: every `HEARTBEAT_EVERY` of the time to live it renews this worker's heartbeat
key (its slot's view, for the front end's /readyz), turns a client's cancel (the record's `cancel_requested`) of a
job it runs into the slot's cancel, and re-queues or fails the jobs of workers whose heartbeat lapsed
(`fleet_store.reap_lost_workers`; any live worker may do it, the script is atomic).

Stopping (SIGTERM, Ctrl-C): the jobs this worker holds go back to the head of the queue, their start not counted,
uploads kept; its heartbeat and claim list are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fleet_store
from .app import WORK_DIR_OWNER, WORK_DIR_PREFIX, remove_stale_work_dirs
from .config import ServiceConfig
from .fleet_store import QUEUE, WORKERS, RedisHistogram, heartbeat_key, job_key, processing_key
from .jobs import Job, JobState
from .supervisor import WorkerSupervisor

if TYPE_CHECKING:
    import redis
    import redis.asyncio

__all__ = ["FleetJob", "FleetQueue", "run_fleet_worker"]

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY = 1 / 4  # of the heartbeat's time to live: three beats may be missed before the worker is lost
CLAIM_WAIT_SECONDS = 1.0  # a claim blocks at most this long, so that stopping never waits on it for longer


@dataclass(eq=False)
class FleetJob(Job):
    """A job this worker claimed; its transitions are written through to its record in Redis."""

    queue: FleetQueue | None = field(default=None, repr=False)

    def start(self, worker_pid: int) -> None:
        super().start(worker_pid)
        assert self.queue is not None
        self.queue.client.hset(job_key(self.id), mapping={
            "state": self.state.value, "started": repr(self.started), "worker_pid": str(worker_pid),
            "worker": self.queue.worker, "attempts": str(self.attempts),
        })

    def progress(self, stage: str, done: int, total: int) -> None:
        super().progress(stage, done, total)
        assert self.queue is not None
        self.queue.client.hset(job_key(self.id), mapping=fleet_store.progress_fields(self))

    def _finish(self, state: JobState) -> None:
        super()._finish(state)
        assert self.queue is not None
        self.queue.ended(self)


class FleetQueue:
    """The fleet's queue, as this worker's supervisor takes jobs from it (`JobQueue`)."""

    def __init__(self, client: redis.Redis, claims: redis.asyncio.Redis, worker: str, output_dir: Path):
        self.client = client
        self.claims = claims  # an asyncio client: a claim blocks
        self.worker = worker  # host:pid
        self.output_dir = output_dir
        self.processing = processing_key(worker)
        self.stopping = False  # set when this worker stops: the jobs it holds go back to the queue

    async def take(self) -> Job:
        """Claim the oldest queued job (atomically moved onto this worker's processing list)."""
        while True:
            job_id = self._unstarted_claim() or await self.claims.blmove(
                QUEUE, self.processing, CLAIM_WAIT_SECONDS, "RIGHT", "LEFT"
            )
            if job_id is None:
                continue
            record = self.client.hgetall(job_key(job_id))
            if not record:  # a record forgotten while queued: nothing to run
                self.client.lrem(self.processing, 1, job_id)
                continue
            job = fleet_store.decode_job(job_id, record, self.output_dir, FleetJob)
            assert isinstance(job, FleetJob)
            job.queue = self
            if not job.cancel_requested:
                return job
            job.cancel()  # cancelled after this worker claimed it, before it started
            release_uploads(job)

    def _unstarted_claim(self) -> str | None:
        """A job claimed by a `take` that was cancelled after Redis moved it (the slot replaced its worker, say):
        still `queued` on this worker's list, so this take runs it."""
        for job_id in self.client.lrange(self.processing, 0, -1):
            if self.client.hget(job_key(job_id), "state") == JobState.QUEUED.value:
                return str(job_id)
        return None

    def put_back(self, job: Job) -> None:
        fleet_store.return_claim(self.client, self.worker, job.id, attempts=0)

    def remove_queued(self, job: Job) -> None:
        self.client.lrem(QUEUE, 1, job.id)

    def drain_queue(self) -> list[Job]:
        """The fleet's queued jobs stay queued when this worker cannot run them: another worker may."""
        return []

    def ended(self, job: FleetJob) -> None:
        if self.stopping and job.state is JobState.FAILED:  # this worker stopped under it: another one runs it
            fleet_store.return_claim(self.client, self.worker, job.id, attempts=1)
            job.upload_dir = None  # the next worker reads them; the slot must not remove them
            logger.info("job %s goes back to the fleet's queue", job.id)
        elif not fleet_store.finish(self.client, self.worker, job):
            logger.warning("job %s was no longer this worker's (its heartbeat lapsed); its end is not recorded", job.id)

    def give_back_claims(self) -> None:
        """Claims that never started (a claim in flight when the worker stopped) go back to the queue."""
        for job_id in self.client.lrange(self.processing, 0, -1):
            fleet_store.return_claim(self.client, self.worker, job_id, attempts=0)


def release_uploads(job: Job) -> None:
    if job.upload_dir is not None:
        shutil.rmtree(job.upload_dir, ignore_errors=True)


async def run_fleet_worker(config: ServiceConfig, redis_url: str, heartbeat_seconds: float) -> str | None:
    """Serve the fleet's queue until stopped (None) or until this worker's configuration cannot run (the reason)."""
    import redis.asyncio

    client = fleet_store.connect(redis_url)
    claims = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    queue = FleetQueue(client, claims, f"{socket.gethostname()}:{os.getpid()}", config.output_dir)
    remove_stale_work_dirs(config.output_dir)
    work_dir = config.output_dir / f"{WORK_DIR_PREFIX}{secrets.token_hex(4)}"
    work_dir.mkdir()
    (work_dir / WORK_DIR_OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    supervisor = WorkerSupervisor(config, queue, work_dir)
    supervisor.request_seconds = RedisHistogram(client)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info("fleet worker %s on %s takes jobs from %s", queue.worker, supervisor.slots[0].devices, redis_url)
    beat(queue, supervisor, heartbeat_seconds)
    slots = asyncio.create_task(supervisor.run(), name="vflash-fleet-slot")
    heart = asyncio.create_task(_heartbeat(queue, supervisor, heartbeat_seconds), name="vflash-fleet-heartbeat")
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({slots, heart, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (heart, stopped):
            task.cancel()
        if slots.done():
            slots.result()  # a crash in the supervisor is a bug: its traceback goes out
            return supervisor.fatal_error or "the worker stopped"
        return None
    finally:
        queue.stopping = True
        slots.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slots
        queue.give_back_claims()
        with client.pipeline() as batch:
            batch.delete(heartbeat_key(queue.worker), queue.processing)
            batch.srem(WORKERS, queue.worker)
            batch.execute()
        shutil.rmtree(work_dir, ignore_errors=True)
        await claims.aclose()
        client.close()


def beat(queue: FleetQueue, supervisor: WorkerSupervisor, heartbeat_seconds: float) -> None:
    """Renew this worker's heartbeat (the time to live of its key) with its slot's view."""
    view: dict[str, Any] = supervisor.worker_views()[0]
    with queue.client.pipeline() as batch:
        batch.set(heartbeat_key(queue.worker), json.dumps(view), px=int(heartbeat_seconds * 1000))
        batch.sadd(WORKERS, queue.worker)
        batch.execute()


async def _heartbeat(queue: FleetQueue, supervisor: WorkerSupervisor, heartbeat_seconds: float) -> None:
    while True:
        beat(queue, supervisor, heartbeat_seconds)
        for slot in supervisor.slots:
            for job in list(slot.running.values()):
                if not job.cancel_requested and queue.client.hget(job_key(job.id), "cancel_requested") == "1":
                    logger.info("job %s: a client cancelled it", job.id)
                    slot.request_cancel(job)
        for job_id in fleet_store.reap_lost_workers(queue.client):
            logger.warning("job %s failed: the fleet worker running it was lost and its retries are spent", job_id)
            upload_dir = queue.client.hget(job_key(job_id), "upload_dir")
            if upload_dir:
                shutil.rmtree(upload_dir, ignore_errors=True)
        await asyncio.sleep(heartbeat_seconds * HEARTBEAT_EVERY)
