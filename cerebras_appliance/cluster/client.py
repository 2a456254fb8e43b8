"""TelemetryClient: buffers the metrics a job pushes and hands them to the cluster client in
batches (at max_buffer_size metrics, after max_buffer_seconds, and when the context ends).

The emulated cluster client keeps what it is handed (`client.telemetry`, a list of
(metrics, labels) pairs), where the real one sends it to the cluster's telemetry service.
"""
from __future__ import annotations

import time


class TelemetryClient:
    def __init__(self, client, max_buffer_size: int = 128, max_buffer_seconds: int = 150):
        if max_buffer_size < 1 or max_buffer_seconds < 0:
            raise ValueError(f"TelemetryClient: max_buffer_size must be >= 1 and max_buffer_seconds >= 0, got "
                             f"{max_buffer_size} and {max_buffer_seconds}")
        self.client, self.max_buffer_size, self.max_buffer_seconds = client, max_buffer_size, max_buffer_seconds
        self._buffer: list = []
        self._since = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()

    def push(self, metrics: dict, labels: dict | None = None) -> None:
        self._buffer.append((dict(metrics), dict(labels or {})))
        if len(self._buffer) >= self.max_buffer_size or time.monotonic() - self._since >= self.max_buffer_seconds:
            self.flush()

    def flush(self) -> None:
        records, self._buffer, self._since = self._buffer, [], time.monotonic()
        if records:
            store = getattr(self.client, "telemetry", None)
            if store is None:
                raise RuntimeError("TelemetryClient: the cluster client keeps no telemetry")
            store.extend(records)
