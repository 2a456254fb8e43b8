"""The wire: everything that crosses between processes.

    protocol.py   every message type, its header schema and validation (the only place one is defined)
    transport.py  ZeroMQ endpoints that send and receive protocol messages
    shm.py        same-host shared-memory segments that carry the weight stream by reference
    auth.py       the job's CURVE keys and the ZAP authenticator
    gate.py       a bound on handshakes in flight per listening socket and per source address
"""
