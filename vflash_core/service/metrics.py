"""`/metrics` in the Prometheus text exposition format (version 0.0.4), written by hand: a handful of series does
not justify a dependency."""

from __future__ import annotations

import bisect
import math

__all__ = ["CONTENT_TYPE", "Histogram", "render"]

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


def render(
    jobs_by_state: dict[str, int], request_seconds: Histogram, worker_restarts: int, ready: bool, queue_capacity: int
) -> str:
    lines = ["# HELP vflash_jobs Jobs known to this process, by state.", "# TYPE vflash_jobs gauge"]
    lines += [f'vflash_jobs{{state="{state}"}} {count}' for state, count in jobs_by_state.items()]
    lines += [
        "# HELP vflash_request_seconds Wall time of succeeded generation requests (VideoResult.elapsed_seconds).",
        "# TYPE vflash_request_seconds histogram",
        *request_seconds.lines("vflash_request_seconds"),
        "# HELP vflash_worker_restarts_total Worker processes started after the first one.",
        "# TYPE vflash_worker_restarts_total counter",
        f"vflash_worker_restarts_total {worker_restarts}",
        "# HELP vflash_ready 1 when /readyz passes.",
        "# TYPE vflash_ready gauge",
        f"vflash_ready {int(ready)}",
        "# HELP vflash_queue_capacity Jobs the queue accepts before answering 429.",
        "# TYPE vflash_queue_capacity gauge",
        f"vflash_queue_capacity {queue_capacity}",
    ]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value))
