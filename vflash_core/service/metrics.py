"""`/metrics` in the Prometheus text exposition format (version 0.0.4), written by hand: a handful of series does
not justify a dependency."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["CONTENT_TYPE", "Histogram", "WorkerSeries", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Generation requests take from seconds (the CPU demo) to tens of minutes (Base16 at 15 s on one GPU).
REQUEST_SECONDS_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 2400.0)


class Histogram:
    """Cumulative-bucket histogram of observed values."""

    def __init__(self, buckets: tuple[float, ...] = REQUEST_SECONDS_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out += [f"{name}_sum {_number(self.total)}", f"{name}_count {self.count}"]
        return out


class WorkerSeries(NamedTuple):
    """One worker slot's numbers."""

    worker: str  # the slot's index
    devices: str  # cpu, cuda:0, cuda:0+cuda:1
    ready: bool
    restarts: int
    jobs: int  # jobs on its worker now: computing, or writing their MP4


def render(
    jobs_by_state: dict[str, int], request_seconds: Histogram, workers: list[WorkerSeries], ready: bool,
    queue_capacity: int,
) -> str:
    lines = ["# HELP vflash_jobs Jobs known to this process, by state.", "# TYPE vflash_jobs gauge"]
    lines += [f'vflash_jobs{{state="{state}"}} {count}' for state, count in jobs_by_state.items()]
    lines += [
        "# HELP vflash_request_seconds Wall time of succeeded generation requests (VideoResult.elapsed_seconds).",
        "# TYPE vflash_request_seconds histogram",
        *request_seconds.lines("vflash_request_seconds"),
        "# HELP vflash_worker_restarts_total Worker processes started after a slot's first one, by slot.",
        "# TYPE vflash_worker_restarts_total counter",
        *_per_worker(workers, "vflash_worker_restarts_total", lambda w: w.restarts),
        "# HELP vflash_worker_ready 1 when the slot's worker passed its checks.",
        "# TYPE vflash_worker_ready gauge",
        *_per_worker(workers, "vflash_worker_ready", lambda w: int(w.ready)),
        "# HELP vflash_worker_jobs Jobs on the slot's worker (computing, or writing their MP4).",
        "# TYPE vflash_worker_jobs gauge",
        *_per_worker(workers, "vflash_worker_jobs", lambda w: w.jobs),
        "# HELP vflash_ready 1 when /readyz passes.",
        "# TYPE vflash_ready gauge",
        f"vflash_ready {int(ready)}",
        "# HELP vflash_queue_capacity Jobs the queue accepts before answering 429.",
        "# TYPE vflash_queue_capacity gauge",
        f"vflash_queue_capacity {queue_capacity}",
    ]
    return "\n".join(lines) + "\n"


def _per_worker(workers: list[WorkerSeries], name: str, value: Callable[[WorkerSeries], int]) -> list[str]:
    return [f'{name}{{worker="{w.worker}",devices="{w.devices}"}} {value(w)}' for w in workers]


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value))
