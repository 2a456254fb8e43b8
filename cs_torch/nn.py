"""Layers and the loss, PyTorch-style names for the project's model description.

    model = cs_torch.module(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Dropout(0.1),
                                          nn.Linear(256, 10)))

`Sequential` builds a `cs_runtime.model.ModelSpec` of dense layers: each
Linear may be followed by one activation and one Dropout, which become that
layer's `activation` and `dropout` (the layers are named fc0, fc1, ... as
`mlp_spec` names them, so both spellings give the same weights). The loss is
softmax cross-entropy, the one loss the CS system's kernels compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from cs_runtime.errors import UserInputError
from cs_runtime.numerics.model import LayerSpec, ModelSpec


class CsTorchError(UserInputError):
    """A use of the API the CS system cannot run; the message is one line."""


@dataclass(frozen=True)
class CrossEntropyLoss:
    """Softmax cross-entropy, mean over the batch (over the predicted tokens of a language model)."""
    reduction: str = "mean"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.reduction != "mean":
            raise CsTorchError(f"CrossEntropyLoss: reduction={self.reduction!r} is not supported (only 'mean')")
        if self.label_smoothing:
            raise CsTorchError("CrossEntropyLoss: label_smoothing is not supported")


@dataclass(frozen=True)
class Linear:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class _Activation:
    kind = "none"


class ReLU(_Activation):
    kind = "relu"


class Tanh(_Activation):
    kind = "tanh"


class Sigmoid(_Activation):
    kind = "sigmoid"


@dataclass(frozen=True)
class GELU(_Activation):
    """torch.nn.GELU: exact (erf) by default, the tanh form with approximate="tanh"."""
    approximate: str = "none"

    def __post_init__(self):
        if self.approximate not in ("none", "tanh"):
            raise CsTorchError(f"GELU: approximate must be 'none' or 'tanh', got {self.approximate!r}")

    @property
    def kind(self) -> str:
        return "gelu" if self.approximate == "none" else "gelu_tanh"


@dataclass(frozen=True)
class Dropout:
    p: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise CsTorchError(f"Dropout: p must be in [0, 1), got {self.p}")


class Sequential:
    """Linear layers, each optionally followed by an activation and a Dropout."""

    def __init__(self, *layers, name: str = "sequential"):
        self.spec = ModelSpec(name, tuple(_dense_layers(layers)))


def _dense_layers(layers) -> list[LayerSpec]:
    out: list[dict] = []
    for i, layer in enumerate(layers):
        where = f"Sequential item {i} ({type(layer).__name__})"
        if isinstance(layer, Linear):
            if out and out[-1]["out_features"] != layer.in_features:
                raise CsTorchError(f"{where}: in_features {layer.in_features} does not match the "
                                   f"previous Linear's out_features {out[-1]['out_features']}")
            out.append({"in_features": layer.in_features, "out_features": layer.out_features,
                        "activation": "none", "dropout": 0.0})
        elif not out:
            raise CsTorchError(f"{where}: a Sequential starts with a Linear")
        elif isinstance(layer, _Activation):
            if out[-1]["activation"] != "none" or out[-1]["dropout"]:
                raise CsTorchError(f"{where}: one activation per Linear, before its Dropout")
            out[-1]["activation"] = layer.kind
        elif isinstance(layer, Dropout):
            if out[-1]["dropout"]:
                raise CsTorchError(f"{where}: one Dropout per Linear")
            out[-1]["dropout"] = layer.p
        else:
            raise CsTorchError(f"{where}: not supported (Linear, ReLU, Tanh, Sigmoid, GELU, Dropout)")
    if not out:
        raise CsTorchError("Sequential: no layers")
    return [LayerSpec(f"fc{i}", "dense", activation=d.pop("activation"), dropout=d.pop("dropout"), **d)
            for i, d in enumerate(out)]


# cstorch.nn's names for torch models, by the module that holds each.
_TORCH_MODULE_NAMES = {"SmoothL1Loss": "nn_losses", "SelectiveGrad": "selective_grad"}


def __getattr__(name: str):
    # cstorch.nn.functional (the real API's); it needs torch, so it is loaded when asked for.
    if name == "functional":
        import importlib
        return importlib.import_module("cs_torch.nn_functional")
    # The real API's Parameter and Buffer defer a tensor's making to the device; tensors live on the
    # host here, so torch's own are those classes.
    if name in ("Parameter", "Buffer"):
        import torch
        return getattr(torch.nn, name)
    if name in _TORCH_MODULE_NAMES:   # torch modules of the real API's nn; they need torch
        import importlib
        return getattr(importlib.import_module(f"cs_torch.{_TORCH_MODULE_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
