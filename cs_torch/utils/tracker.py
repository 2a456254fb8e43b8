"""cstorch.utils.tracker.RateTracker: counts (samples) and their rate since a reset.

    tracker = RateTracker(); tracker.add(64); tracker.rate(); tracker.global_rate()

`rate()` is smoothed over the adds (each add moves it `1 - smooth_factor` of the
way to the latest add's rate); `global_rate()` is the count over the time since
the reset.
"""
from __future__ import annotations

import time


class RateTracker:
    def __init__(self, smooth_factor: float = 0.4):
        if not 0.0 <= smooth_factor < 1.0:
            raise ValueError(f"RateTracker: smooth_factor must be in [0, 1), got {smooth_factor!r}")
        self.smooth_factor = smooth_factor
        self.reset()

    def reset(self) -> None:
        self.total_count, self._rate = 0, 0.0
        self._start = self._last = time.monotonic()

    def add(self, count: int) -> None:
        now = time.monotonic()
        if now > self._last:
            latest = count / (now - self._last)
            self._rate = self._rate * self.smooth_factor + latest * (1.0 - self.smooth_factor)
        self._last = now
        self.total_count += count

    update = add

    def rate(self) -> float:
        return self._rate

    def elapsed_seconds(self) -> float:
        return time.monotonic() - self._start

    def global_rate(self) -> float:
        elapsed = self.elapsed_seconds()
        return self.total_count / elapsed if elapsed > 0 else 0.0
