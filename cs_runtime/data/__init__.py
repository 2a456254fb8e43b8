"""Input data: data sets and how batches are cut and sharded.

    mnist.py    MNIST (IDX files) and the embedded digits
    batches.py  which samples form which global batch (BatchPlan), and each rank's and worker's share
    text.py     the byte-level text data of the language models
    hdf5.py     the model zoo's preprocessed GPT-2 / BERT HDF5 files (with h5py)
    inputs.py   InputStream: a data set's batches for one worker or WSE
"""
