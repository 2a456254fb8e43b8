"""MemoryX: the master weights and optimizer state of a job.

    server.py    the service: streams each layer's weights out, applies summed gradients
    __main__.py  python -m cs_runtime.memoryx (started by the launcher)
"""
