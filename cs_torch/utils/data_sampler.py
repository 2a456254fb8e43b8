"""cstorch.utils.data.sampler: pad_index, the index a sampler yields for a padding sample.

A data set's __getitem__ answers it with a padding sample; the emulator's loaders never pad (the
torch DataLoader's own samplers are replayed, cs_torch/loader_replay.py), so it is a sentinel that
no real index equals.
"""
pad_index = -1
