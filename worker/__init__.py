"""The input worker: runs the user's input function on its share of the batches.

    __main__.py      python -m worker run.py ARGS... (started by csrun_wse)
    input_worker.py  makes its steps' batches and streams each WSE its rows
    probe.py         the input-throughput probe cs_input_analyzer runs
"""
