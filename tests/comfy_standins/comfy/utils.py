"""Stand-in for `comfy.utils`: the global progress hook and `ProgressBar` (ComfyUI 0.33.0 semantics).

The server installs a hook that first calls `throw_exception_if_processing_interrupted()`, then records progress;
tests install their own hook with `set_progress_bar_global_hook`. Updates are throttled like core: the first, the
final and preview updates always go out, others at least 100 ms and 0.5 % apart.
"""

import time

PROGRESS_BAR_HOOK = None
PROGRESS_THROTTLE_MIN_INTERVAL = 0.1
PROGRESS_THROTTLE_MIN_PERCENT = 0.5


def set_progress_bar_global_hook(function):
    global PROGRESS_BAR_HOOK
    PROGRESS_BAR_HOOK = function


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total = total
        self.current = 0
        self.hook = PROGRESS_BAR_HOOK
        self.node_id = node_id
        self._last_update_time = 0.0
        self._last_sent_value = -1

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        value = min(value, self.total)
        self.current = value
        if self.hook is None:
            return
        now = time.perf_counter()
        if preview is not None or self._last_sent_value < 0 or value >= self.total:
            send = True
        else:
            percent = (value - max(0, self._last_sent_value)) / self.total * 100 if self.total > 0 else 100
            send = now - self._last_update_time >= PROGRESS_THROTTLE_MIN_INTERVAL and percent >= PROGRESS_THROTTLE_MIN_PERCENT
        if send:
            self.hook(self.current, self.total, preview, node_id=self.node_id)
            self._last_update_time = now
            self._last_sent_value = value

    def update(self, value):
        self.update_absolute(self.current + value)
