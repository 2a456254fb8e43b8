"""The chief: compiles the model, drives the steps, writes TensorBoard and checkpoints.

    __main__.py          python -m chief run.py ARGS... (started by csrun_wse)
    trainer.py           the training loop, shared by the CPU path and the CS system
    cpu_executor.py      the CPU path: the whole model and global batch in this process (the oracle)
    cluster_executor.py  the CS system's side: drives MemoryX, SwarmX and the WSEs
    input_monitor.py     is the input pipeline keeping the WSEs fed? measured from the chief
    summaries.py         the TensorBoard event files, and a full disk met while writing them
    story.py             what a run tells: its first step, progress by time, the end summary, how to resume
"""
