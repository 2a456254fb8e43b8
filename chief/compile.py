"""The chief's compile stage (validate the model before anything runs).

For now: every layer's op must be a supported kernel, its activation known,
its dropout in [0, 1), and each layer's input width must equal the previous
layer's output width. Errors name the layer and the op.
"""
from __future__ import annotations

import logging

from cs_runtime.model import ACTIVATIONS, ModelSpec

log = logging.getLogger("chief")

SUPPORTED_OPS = ("dense",)


class CompileError(ValueError):
    pass


def validate(spec: ModelSpec) -> None:
    if not spec.layers:
        raise CompileError(f"model {spec.name} has no layers")
    width = spec.layers[0].in_features
    for layer in spec.layers:
        where = f"layer {layer.name} (op {layer.op})"
        if layer.op not in SUPPORTED_OPS:
            raise CompileError(f"{where}: unsupported op; supported: {', '.join(SUPPORTED_OPS)}")
        if layer.activation not in ACTIVATIONS:
            raise CompileError(f"{where}: unsupported activation {layer.activation!r}")
        if not 0.0 <= layer.dropout < 1.0:
            raise CompileError(f"{where}: dropout {layer.dropout} outside [0, 1)")
        if layer.in_features != width:
            raise CompileError(f"{where}: takes {layer.in_features} features but receives {width}")
        width = layer.out_features


def compile_model(spec: ModelSpec, args) -> dict:
    validate(spec)
    log.info("validated %s: %d layers, %d parameters", spec.name, len(spec.layers), spec.num_params())
    return {"execution_strategy": "weight_streaming"}
