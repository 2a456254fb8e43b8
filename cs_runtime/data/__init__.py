"""Input data: data sets and how batches are cut and sharded.

    mnist.py   MNIST (IDX files) and the embedded digits; BatchPlan, shard_rows, worker_steps
    text.py    the byte-level text data of the language models
    inputs.py  InputStream: a data set's batches for one worker or WSE
"""
