"""cstorch.utils.call_once.call_once: a function that runs on its first call only.

    @call_once()
    def setup(): ...        # later calls do nothing and return the first call's result
"""
from __future__ import annotations

import functools
import threading


def call_once():
    def decorate(fn):
        lock, result, done = threading.Lock(), [None], [False]

        @functools.wraps(fn)
        def once(*args, **kwargs):
            with lock:     # two threads calling first: one runs, the other waits for its result
                if not done[0]:
                    result[0] = fn(*args, **kwargs)
                    done[0] = True
            return result[0]
        return once
    return decorate
