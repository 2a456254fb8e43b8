"""The maths, in numpy: what every path (CPU, WSE, pipelined) computes.

    kernels.py      matmul-level kernels and their gradients
    model.py        ModelSpec, weight init, per-layer forward/backward and the loss
    transformer.py  the transformer layer ops (attention, layer norm, embedding, LM head)
    optim.py        SGD, Adam, AdamW, schedules, gradient clipping
    precision.py    16-bit formats, rounding, loss scaling
    compiled.py     the optional C loops (_convert.c, _gelu.c) where built, else None
"""
