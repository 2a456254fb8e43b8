"""The input-worker process: `python -m worker run.py ARGS...` (started by csrun_wse).

Runs the user's script as an input worker: it builds the user's input
function and streams its share of the batches to its WSE.
"""
from cs_runtime.user_script import run_script_as

if __name__ == "__main__":
    run_script_as("worker")
