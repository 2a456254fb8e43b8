"""The line a cs_input_analyzer probe prints: `PROBE kind [json]`.

Both probes (worker/probe.py, wse/probe.py) print it and the analyzer reads
it from their stdout; one helper keeps the two sides spelling it alike.
"""
from __future__ import annotations

import json


def say(kind: str, payload: dict | None = None) -> None:
    print(f"PROBE {kind}" + (f" {json.dumps(payload)}" if payload is not None else ""), flush=True)
