"""cs_system: a long-lived emulated CS system that many jobs share.

    cs_system serve [--port 9000] [--num_csx 2] [--host 127.0.0.1] [--insecure] [--no_shm]
    csrun_wse --cs_ip 127.0.0.1:9000 python examples/fc_mnist/run.py --mode train --params ...
    csctl --cs_ip 127.0.0.1:9000 get jobs

It starts the front door (jobs queue there and run in order, one at a time
per CS system) and keeps MemoryX, SwarmX and WSE processes ready for the
next job; see cs_runtime/appliance/server.py. Ctrl-C (or SIGTERM) stops it, every
job's processes and its own, and deletes what they left in /dev/shm.
"""
from __future__ import annotations

import argparse
import sys

from cs_runtime.flags import add_flag
from cs_runtime.process.service import setup_logging
from cs_runtime.wire import auth
from cs_runtime.wire.transport import PortInUse
from cs_runtime.version import version_line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cs_system", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("cs_system"))
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a CS system until Ctrl-C", allow_abbrev=False)
    for flag, kwargs in (("port", dict(type=int, default=9000, help="front-door port (default 9000; 0: any free one)")),
                         ("num_csx", dict(type=int, default=1, help="CS systems (WSE emulators; default 1)")),
                         ("host", dict(default="127.0.0.1",
                                       help="address to serve on (default 127.0.0.1; another address of this "
                                            "machine to take jobs from other hosts)")),
                         ("insecure", dict(action="store_true", help="no CURVE (loopback only)")),
                         ("no_shm", dict(action="store_true", help="stream weights over tcp, not shared memory")),
                         ("clients", dict(default=None, metavar="FILE",
                                          help="admit only these clients: one `USER PUBLIC_KEY` a line (the key "
                                               "`csctl key` prints); the USER of their jobs comes from here")),
                         ("turn_timeout", dict(type=float, default=None, metavar="S",
                                               help="a job whose chief has not arrived S seconds after its turn "
                                                    "came fails, and the next job goes (default 120)"))):
        add_flag(serve, flag, **kwargs)
    ns = parser.parse_args(argv)
    if ns.num_csx < 1:
        parser.error("--num_csx must be at least 1")
    if not 0 <= ns.port < 65536:
        parser.error("--port must be in [0, 65535]")
    if ns.host in ("0.0.0.0", "::", "*"):
        parser.error(f"--host {ns.host}: give the one address of this machine that clients reach")
    if ns.insecure and not auth.is_loopback(ns.host):
        parser.error(f"--insecure is for loopback only, not {ns.host}")
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("cs_system")
    from cs_runtime.appliance.server import TURN_TIMEOUT_S, CSSystem, read_clients
    try:
        clients = read_clients(ns.clients) if ns.clients else None
    except ValueError as exc:
        raise SystemExit(f"cs_system: {exc}") from None
    if clients is not None and ns.insecure:
        raise SystemExit("cs_system: --clients needs CURVE (the keys are the clients' identities): drop --insecure")
    try:
        system = CSSystem(ns.host, ns.port, ns.num_csx, ns.insecure, shm=not ns.no_shm, clients=clients,
                          turn_timeout_s=ns.turn_timeout or TURN_TIMEOUT_S)
    except PortInUse as exc:
        raise SystemExit(f"cs_system: --port: {exc}") from None
    except (OSError, auth.AuthError) as exc:
        raise SystemExit(f"cs_system: cannot serve on {ns.host}:{ns.port}: {exc}") from None
    key = (f"; front-door public key {system.public_key} (export CS_SYSTEM_KEY='{system.public_key}' "
           f"on client machines; here it is also in {system.keys_dir}/server.key)") if system.public_key \
        else " (--insecure: no CURVE)"
    print(f"cs_system: serving {ns.num_csx} CS system(s) at {system.where}{key}", flush=True)
    print(f"cs_system: submit with: csrun_wse --cs_ip {system.where}{' --insecure' if ns.insecure else ''} "
          f"python run.py ...; list with: csctl --cs_ip {system.where} get jobs", flush=True)
    system.serve_forever()


if __name__ == "__main__":
    main()
