"""SwarmX: the fabric between MemoryX and the WSEs.

    server.py    the service: broadcasts weights to every WSE, sums their gradients and losses
    __main__.py  python -m cs_runtime.swarmx (started by the launcher)
"""
