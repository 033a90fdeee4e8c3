"""The fleet's jobs in Redis: records, the queue, the workers' claims and heartbeats, and the scripts that move a job
between them atomically. The front end (`fleet_front`) and the fleet workers (`fleet_worker`) share this module; it
is the only one that knows the keys.

Keys (all under `vflash:`):

* `job:<id>`, a hash: the record a client sees (`Job` fields as strings), the validated request as JSON, the upload
  folder, the published file's name (each host joins it to its own mount of the shared output folder), `attempts`
  (starts), `retries` (how many times a lost worker's job is run again) and `worker` (the one that started it last).
* `queue`, a list: queued job ids, newest on the left; a worker claims the oldest with `BLMOVE` onto its own
  `processing:<worker>` list, atomically, and removes it from there when the job ends (the ack).
* `worker:<worker>`, a string with a time to live: the worker's heartbeat (its slot's view, as JSON); `workers`, a
  set, names every worker that claimed jobs. A worker whose heartbeat lapsed is lost: `reap` puts each job on its
  processing list back at the head of the queue, or fails it, record kept, once it has used its retries.
* `jobs` and `ended`, sorted sets of ids by creation and end time (counts, and forgetting the oldest ended records);
  `request-seconds`, a hash: the histogram of succeeded jobs' wall times.

redis-py is imported only here and only when a connection is made, so the single-host service needs no Redis.
"""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .jobs import Job, JobState
from .metrics import Histogram

if TYPE_CHECKING:
    import redis

__all__ = [
    "PREFIX", "QUEUE", "WORKERS", "RedisHistogram", "connect", "decode_job", "encode_job", "heartbeat_key", "job_key",
    "processing_key", "reap_lost_workers",
]

PREFIX = "vflash:"
QUEUE = PREFIX + "queue"
WORKERS = PREFIX + "workers"
JOBS = PREFIX + "jobs"
ENDED = PREFIX + "ended"
REQUEST_SECONDS = PREFIX + "request-seconds"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def processing_key(worker: str) -> str:
    return f"{PREFIX}processing:{worker}"


def heartbeat_key(worker: str) -> str:
    return f"{PREFIX}worker:{worker}"


def connect(url: str) -> redis.Redis:
    """A client of the fleet's Redis (`redis://host:port/db`); strings in, strings out. Fails at once when the
    server cannot be reached, with the reason in one line."""
    import redis

    from ..errors import RunFailedError

    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=10)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RunFailedError(f"cannot reach the fleet's Redis at {url}: {exc}") from None
    return client


# -- records ------------------------------------------------------------------------------------------------------

_REQUEST_FIELDS = ("prompt", "first_frame", "last_frame", "references", "duration_seconds", "seed", "width", "height")


def encode_job(job: Job, retries: int) -> dict[str, str]:
    """A new job's hash. Its request's media inputs are paths (the service takes files only), valid on every host
    because the upload and input folders are shared at the same path."""
    request = {name: getattr(job.request, name) for name in _REQUEST_FIELDS}
    request["references"] = [str(path) for path in request["references"]]
    for name in ("first_frame", "last_frame"):
        request[name] = None if request[name] is None else str(request[name])
    return {
        "request": json.dumps(request), "upload_dir": "" if job.upload_dir is None else str(job.upload_dir),
        "created": repr(job.created), "state": job.state.value, "attempts": "0", "retries": str(retries),
        "cancel_requested": "0",
    }


def decode_job(job_id: str, record: dict[str, str], output_dir: Path, kind: type[Job] = Job) -> Job:
    """A `Job` (or `kind` of job) as the record says now; changing the snapshot changes nothing in Redis."""
    from ..pipeline.validation import VideoRequest

    def number(name: str, kind: type = float) -> Any:
        return kind(record[name]) if record.get(name) else None

    request = json.loads(record["request"])
    request["references"] = tuple(request["references"])
    job = kind(job_id, VideoRequest(**request), Path(record["upload_dir"]) if record.get("upload_dir") else None,
              created=float(record["created"]), state=JobState(record["state"]))
    job.started, job.finished, job.worker_pid = number("started"), number("finished"), number("worker_pid", int)
    job.attempts = int(record.get("attempts") or 0)
    job.stage = record.get("stage") or None
    job.stage_done, job.stage_total = int(record.get("stage_done") or 0), int(record.get("stage_total") or 0)
    job.evaluations_done = int(record.get("evaluations_done") or 0)
    job.evaluations_total = number("evaluations_total", int)
    job.cancel_requested = record.get("cancel_requested") == "1"
    job.error = record.get("error") or None
    job.output = output_dir / record["output"] if record.get("output") else None
    job.result = json.loads(record["result"]) if record.get("result") else None
    return job


def progress_fields(job: Job) -> dict[str, str]:
    return {
        "stage": job.stage or "", "stage_done": str(job.stage_done), "stage_total": str(job.stage_total),
        "evaluations_done": str(job.evaluations_done),
        "evaluations_total": "" if job.evaluations_total is None else str(job.evaluations_total),
    }


def ended_fields(job: Job) -> dict[str, str]:
    return {
        "state": job.state.value, "finished": repr(job.finished), "error": job.error or "",
        "output": "" if job.output is None else job.output.name,
        "result": "" if job.result is None else json.dumps(job.result),
    }


# -- scripts ------------------------------------------------------------------------------------------------------
# Each runs atomically in Redis. The keys they touch are named from the arguments (one Redis server, not a cluster).

# A worker's ack: the record ends only while the job is still this worker's (a worker declared lost whose job went to
# another worker must not overwrite that worker's record). ARGV: processing list, job id, then field/value pairs.
FINISH = """
if redis.call('LREM', ARGV[1], 1, ARGV[2]) == 0 then return 0 end
local job = KEYS[1]
for i = 3, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], redis.call('HGET', job, 'finished'), ARGV[2])
return 1
"""

# A claimed job goes back to the head of the queue, its start not counted (a job taken that never reached the
# worker, or one a stopping worker gives up). ARGV: processing list, job id, attempts to give back.
RETURN = """
if redis.call('LREM', ARGV[1], 1, ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'started', '', 'worker_pid', '', 'stage', '', 'stage_done', '0',
           'stage_total', '0', 'evaluations_done', '0', 'evaluations_total', '')
redis.call('HINCRBY', KEYS[1], 'attempts', -tonumber(ARGV[3]))
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
"""

# A queued job is cancelled at once; any other is flagged, for the worker that runs it to stop (returns 0).
CANCEL = """
if redis.call('LREM', KEYS[2], 1, ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished', ARGV[2], 'cancel_requested', '1')
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
  return 1
end
redis.call('HSET', KEYS[1], 'cancel_requested', '1')
return 0
"""

# Every worker whose heartbeat lapsed: each job it held runs again (at the head of the queue) while it has retries
# left, else fails with its record kept. Returns the failed jobs' ids (their uploads are removed by the caller).
# ARGV: the prefix, now.
REAP = """
local prefix, now, failed = ARGV[1], ARGV[2], {}
for _, worker in ipairs(redis.call('SMEMBERS', prefix .. 'workers')) do
  if redis.call('EXISTS', prefix .. 'worker:' .. worker) == 0 then
    local processing = prefix .. 'processing:' .. worker
    local held = redis.call('LRANGE', processing, 0, -1)
    for i = #held, 1, -1 do
      local id = held[i]
      local job = prefix .. 'job:' .. id
      local state = redis.call('HGET', job, 'state')
      local attempts = tonumber(redis.call('HGET', job, 'attempts') or '0')
      local retries = tonumber(redis.call('HGET', job, 'retries') or '0')
      if state == 'queued' or (state == 'running' and attempts <= retries) then
        redis.call('HSET', job, 'state', 'queued', 'started', '', 'worker_pid', '', 'stage', '', 'stage_done', '0',
                   'stage_total', '0', 'evaluations_done', '0', 'evaluations_total', '')
        redis.call('RPUSH', prefix .. 'queue', id)
      elseif state == 'running' then
        local error = 'the fleet worker ' .. worker .. ' running this job was lost (its heartbeat stopped)'
        if attempts > 1 then error = error .. ', on its attempt ' .. attempts .. ' of ' .. (retries + 1) end
        redis.call('HSET', job, 'state', 'failed', 'finished', now, 'error', error)
        redis.call('ZADD', prefix .. 'ended', now, id)
        table.insert(failed, id)
      end
    end
    redis.call('DEL', processing)
    redis.call('SREM', prefix .. 'workers', worker)
  end
end
return failed
"""


def finish(client: redis.Redis, worker: str, job: Job) -> bool:
    """Write an ended job's record and release the worker's claim; False if the job is no longer this worker's."""
    fields = [item for pair in ended_fields(job).items() for item in pair]
    return bool(client.eval(FINISH, 2, job_key(job.id), ENDED, processing_key(worker), job.id, *fields))


def return_claim(client: redis.Redis, worker: str, job_id: str, attempts: int) -> bool:
    return bool(client.eval(RETURN, 2, job_key(job_id), QUEUE, processing_key(worker), job_id, attempts))


def cancel(client: redis.Redis, job_id: str) -> bool:
    """True when the job was queued and is now cancelled; False when its worker is asked to stop it."""
    return bool(client.eval(CANCEL, 3, job_key(job_id), QUEUE, ENDED, job_id, repr(time.time())))


def reap_lost_workers(client: redis.Redis) -> list[str]:
    """Re-queue or fail the jobs of workers whose heartbeat lapsed; returns the failed jobs' ids."""
    return list(client.eval(REAP, 0, PREFIX, repr(time.time())))


class RedisHistogram(Histogram):
    """The fleet's histogram of request seconds: each worker adds its observations in Redis; `load` reads the sum
    of all of them (the front end's /metrics)."""

    def __init__(self, client: redis.Redis):
        super().__init__()
        self._client = client

    def observe(self, value: float) -> None:
        super().observe(value)
        with self._client.pipeline() as batch:  # MULTI: the buckets, sum and count move together
            batch.hincrby(REQUEST_SECONDS, f"bucket:{bisect.bisect_left(self.buckets, value)}", 1)
            batch.hincrbyfloat(REQUEST_SECONDS, "sum", value)
            batch.hincrby(REQUEST_SECONDS, "count", 1)
            batch.execute()

    @staticmethod
    def load(client: redis.Redis) -> Histogram:
        stored = client.hgetall(REQUEST_SECONDS)
        histogram = Histogram()
        histogram.counts = [int(stored.get(f"bucket:{index}", 0)) for index in range(len(histogram.counts))]
        histogram.total, histogram.count = float(stored.get("sum", 0.0)), int(stored.get("count", 0))
        return histogram
