"""The maths, in numpy: what every path (CPU, WSE, pipelined) computes. No torch.

    model.py             ModelSpec and LayerSpec, weight initialisation, the layers' parameter shapes
    transformer_params.py  the transformer layers' parameter shapes and initialisation
    program.py           a compiled program as data: parameters, inputs, constants, nodes
    program_layer.py     layers whose maths is a compiled program (captured models' units, tied weights)
    ops.py               the op set: per op a forward, a vector-Jacobian rule, a shape rule and a cost
    mixed_ops.py         the 16-bit rule of the matmul-like ops
    kernels.py           the numpy kernels behind the op set
    windows.py           convolution and pooling kernels: im2col and one matmul, depthwise, window offsets
    hashing.py           counter-based draws: the same (key, row, element) in any process, on any shard
    local_step.py        one training step on weights held in this process (CPU path, pipelined WSE, probe)
    executor.py          the one executor of compiled programs (forward, backward, a unit at a time)
    batch_check.py       what a batch must be before a model computes on it; the ignored label
    optim.py             the learning rule (OptimizerSpec) and its application: SGD, Adam, AdamW, clipping
    precision.py         16-bit formats, rounding, loss scaling
    parallel.py          large products and passes cut into pieces that run side by side, same bits
    blas.py              how many BLAS threads a product gets
    compiled.py          the optional C loops (_convert.c, _gelu.c, _optim.c, _masks.c, _windows.c, _norms.c)
                         where built, else None
"""
