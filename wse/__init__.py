"""The WSE emulator: executes each layer as its weights arrive, activations kept resident.

    __main__.py   python -m wse (started by csrun_wse or the CS system)
    emulator.py   the process: receives the job's settings, batches and weights; picks the executor
    pipelined.py  the layer-pipelined executor: every weight on the wafer, updated in place
    probe.py      the consumption probe cs_input_analyzer runs
"""
