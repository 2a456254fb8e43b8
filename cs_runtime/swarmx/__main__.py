"""python -m cs_runtime.swarmx: the SwarmX service of a job (started by the launcher)."""
from cs_runtime.process.service import service_main
from cs_runtime.swarmx.server import main

service_main("swarmx", main)
