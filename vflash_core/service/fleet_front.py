"""The fleet front end: `vflash serve --redis URL` keeps no job in its own memory. A submission is written to Redis
(record and queue place, in one transaction) before the 202 answers it; every status, video and cancel reads or
writes Redis; `/readyz` and `/metrics` report the fleet workers' heartbeats. A restarted front end, or another one
beside it, serves the same jobs.

Its calls to Redis are short and synchronous on the event loop (a loopback or LAN round trip each; the client's
socket timeout bounds a stalled server).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fleet_store
from .fleet_store import JOBS, QUEUE, WORKERS, RedisHistogram, heartbeat_key, job_key
from .jobs import Job, JobState, QueueFullError
from .metrics import Histogram, WorkerSeries
from .supervisor import WorkerState

if TYPE_CHECKING:
    import redis

__all__ = ["FLEET_UPLOADS", "FleetJobStore", "FleetWorkers", "fleet_uploads"]

#: Uploads of a fleet's jobs, inside the shared output folder: the workers read them there, and they outlive the
#: front end that received them; the worker that ends the job removes them.
FLEET_UPLOADS = ".vflash-fleet/uploads"


def fleet_uploads(output_dir: Path) -> Path:
    return output_dir / FLEET_UPLOADS


class FleetJobStore:
    """The job records of the HTTP handlers (`JobRecords`), in Redis."""

    def __init__(self, client: redis.Redis, output_dir: Path, max_queue: int, keep_finished: int, retries: int):
        self.client = client
        self.output_dir = output_dir
        self.max_queue = max_queue
        self.keep_finished = keep_finished
        self.retries = retries

    def get(self, job_id: str) -> Job | None:
        record = self.client.hgetall(job_key(job_id))
        return fleet_store.decode_job(job_id, record, self.output_dir) if record else None

    def check_capacity(self) -> None:
        if self.client.llen(QUEUE) >= self.max_queue:
            raise QueueFullError(f"the queue is full ({self.max_queue} jobs waiting); retry later")

    def add(self, job: Job) -> None:
        """Persisted (record, then its queue place, in one MULTI) before the caller answers 202."""
        self.check_capacity()
        self._forget_finished()
        with self.client.pipeline() as batch:
            batch.hset(job_key(job.id), mapping=fleet_store.encode_job(job, self.retries))
            batch.zadd(JOBS, {job.id: job.created})
            batch.lpush(QUEUE, job.id)
            batch.execute()

    def _forget_finished(self) -> None:
        """Records of the oldest ended jobs beyond `keep_finished` are deleted; their videos stay."""
        forgotten = self.client.zrange(fleet_store.ENDED, 0, -(self.keep_finished + 1))
        if forgotten:
            with self.client.pipeline() as batch:
                batch.delete(*(job_key(job_id) for job_id in forgotten))
                batch.zrem(fleet_store.ENDED, *forgotten)
                batch.zrem(JOBS, *forgotten)
                batch.execute()

    def queue_position(self, job: Job) -> int | None:
        """1 for the next job to run (the queue's right end); None when the job is not queued."""
        if job.state is not JobState.QUEUED:
            return None
        with self.client.pipeline(transaction=True) as batch:
            batch.lpos(QUEUE, job.id)
            batch.llen(QUEUE)
            index, length = batch.execute()
        return None if index is None else length - index

    def counts(self) -> dict[JobState, int]:
        counts = dict.fromkeys(JobState, 0)
        ids = self.client.zrange(JOBS, 0, -1)
        with self.client.pipeline(transaction=False) as batch:
            for job_id in ids:
                batch.hget(job_key(job_id), "state")
            for state in batch.execute():
                if state is not None:
                    counts[JobState(state)] += 1
        return counts


class FleetWorkers:
    """What the HTTP handlers ask of the workers (`WorkerPool`), answered from the fleet workers' heartbeats."""

    fatal_error: str | None = None  # a fleet front end has no configuration a worker could refuse

    def __init__(self, client: redis.Redis):
        self.client = client

    def worker_views(self) -> list[dict[str, Any]]:
        """Each live fleet worker's slot view, with its `worker` name (host:pid); lost ones are not listed."""
        names = sorted(self.client.smembers(WORKERS))
        beats = self.client.mget([heartbeat_key(name) for name in names]) if names else []
        return [{"worker": name, **json.loads(beat)} for name, beat in zip(names, beats) if beat is not None]

    @property
    def state(self) -> WorkerState:
        """Ready while any fleet worker is; starting while none is (jobs are accepted and wait for one)."""
        ready = any(view["state"] == WorkerState.READY.value for view in self.worker_views())
        return WorkerState.READY if ready else WorkerState.STARTING

    @property
    def request_seconds(self) -> Histogram:
        return RedisHistogram.load(self.client)

    def worker_series(self) -> list[WorkerSeries]:
        return [
            WorkerSeries(view["worker"], view["devices"], view["state"] == WorkerState.READY.value, view["restarts"],
                         len(view["jobs"]))
            for view in self.worker_views()
        ]

    def cancel(self, job: Job) -> None:
        """A queued job is cancelled now; a running one is flagged, and its worker stops it within a heartbeat."""
        if fleet_store.cancel(self.client, job.id):
            job.cancel_requested = True
            job.cancel()
            if job.upload_dir is not None:
                shutil.rmtree(job.upload_dir, ignore_errors=True)
        else:
            job.cancel_requested = True

