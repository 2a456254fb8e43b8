"""The WSE emulator process: `python -m wse` (started by csrun_wse or the appliance)."""
from __future__ import annotations

import logging

import zmq

from cs_runtime.process.service import ProcessEnv, join_cs_system, service_main
from wse.emulator import WSE


def main(penv: ProcessEnv, ctx: zmq.Context) -> None:
    wse = WSE(penv, ctx)
    directory = join_cs_system(penv, ctx, {"input": wse.input_address})
    swarmx = directory.lookup(["swarmx"])["swarmx"][0]
    wse.connect_swarmx(ctx, swarmx["endpoints"]["router"])
    logging.getLogger("wse").info("WSE %d ready, input at %s", penv.rank, wse.input_address)
    wse.serve()


if __name__ == "__main__":
    service_main("wse", main)
