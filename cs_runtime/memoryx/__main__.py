"""python -m cs_runtime.memoryx: the MemoryX service of a job (started by the launcher)."""
from cs_runtime.memoryx.server import main
from cs_runtime.process.service import service_main

service_main("memoryx", main)
