"""The model: layer specs, weight initialisation and the numpy kernels.

A model is a list of `LayerSpec`s (one weight-streaming unit each) followed by
a softmax cross-entropy loss. The same kernels run in the CPU oracle and in
every WSE emulator, so the maths is identical by construction; only the rows
of the batch (data-parallel shards) and the summation order of gradients
across WSEs differ.

Conventions that make data parallel equal the oracle:
- losses and gradients are scaled by 1/global_batch on every shard, so the sum
  over shards (SwarmX's reduce) is the mean over the global batch;
- the dropout mask of step s, layer l is drawn for the whole global batch from
  a generator seeded by (seed, s, l) and each shard takes its own rows, so a
  sample gets the same mask whichever WSE holds it.

Mixed precision (`ModelSpec.precision` other than float32): every matmul
takes its inputs (activations or deltas, and weights) rounded to the 16-bit
format and accumulates in float32; biases are used in the 16-bit format too
(they stream as the weights do), and the weight gradients come out in the
16-bit format, as a 16-bit matmul on the wafer emits them. Activation
functions, the loss and the master weights stay float32.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .precision import FORMATS, quantize

ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "none")


@dataclass(frozen=True)
class LayerSpec:
    name: str
    op: str                  # "dense": y = act(x @ W + b), then dropout
    in_features: int
    out_features: int
    activation: str = "none"
    dropout: float = 0.0

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.in_features, self.out_features), "bias": (self.out_features,)}

    def num_params(self) -> int:
        return self.in_features * self.out_features + self.out_features


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[LayerSpec, ...]
    loss: str = "softmax_cross_entropy"
    precision: str = "float32"   # the format of matmul inputs and weight gradients

    def __post_init__(self):
        if self.precision not in FORMATS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {sorted(FORMATS)}")

    def to_dict(self) -> dict:
        return {"name": self.name, "loss": self.loss, "precision": self.precision,
                "layers": [asdict(l) for l in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        layers = tuple(LayerSpec(**layer) for layer in d["layers"])
        return cls(name=str(d["name"]), layers=layers, loss=str(d.get("loss", "softmax_cross_entropy")),
                   precision=str(d.get("precision", "float32")))

    def num_params(self) -> int:
        return sum(layer.num_params() for layer in self.layers)


def mlp_spec(name: str, sizes: list[int], activation: str, dropout: float) -> ModelSpec:
    """A fully connected classifier: hidden layers get activation + dropout, the last neither."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layers.append(LayerSpec(f"fc{i}", "dense", n_in, n_out,
                                activation="none" if last else activation,
                                dropout=0.0 if last else dropout))
    return ModelSpec(name, tuple(layers))


def init_weights(spec: ModelSpec, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """PyTorch-style uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) init, deterministic in seed."""
    weights = {}
    for i, layer in enumerate(spec.layers):
        rng = np.random.default_rng([seed, 7919, i])
        bound = 1.0 / np.sqrt(layer.in_features)
        weights[layer.name] = {
            name: rng.uniform(-bound, bound, size=shape).astype(np.float32)
            for name, shape in layer.param_shapes().items()
        }
    return weights


# ---------------------------------------------------------------- activations

def _gelu(x: np.ndarray) -> np.ndarray:
    # tanh approximation, as in GPT-2 and most wafer kernels
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def _gelu_grad(x: np.ndarray) -> np.ndarray:
    inner = 0.7978845608 * (x + 0.044715 * x ** 3)
    t = np.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608 * (1.0 + 3 * 0.044715 * x * x)


def activate(kind: str, z: np.ndarray) -> np.ndarray:
    if kind == "relu":
        return np.maximum(z, 0.0)
    if kind == "tanh":
        return np.tanh(z)
    if kind == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if kind == "gelu":
        return _gelu(z)
    return z


def activation_grad(kind: str, z: np.ndarray, a: np.ndarray) -> np.ndarray:
    """d act / d z, given the pre-activation z and the activation a."""
    if kind == "relu":
        return (z > 0).astype(z.dtype)
    if kind == "tanh":
        return 1.0 - a * a
    if kind == "sigmoid":
        return a * (1.0 - a)
    if kind == "gelu":
        return _gelu_grad(z).astype(z.dtype)
    return np.ones_like(z)


# ---------------------------------------------------------------- dropout

def dropout_mask(seed: int, step: int, layer_index: int, global_batch: int, width: int,
                 rows: slice, p: float) -> np.ndarray:
    """Scaled keep-mask (0 or 1/(1-p)) for `rows` of the global batch of `step`."""
    rng = np.random.default_rng([seed, step, layer_index, 104729])
    keep = rng.random((global_batch, width), dtype=np.float32)[rows] >= p
    return keep.astype(np.float32) / np.float32(1.0 - p)


# ---------------------------------------------------------------- dense layer

def _rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as a matmul input of `fmt` (untouched in float32, so float64 gradient checks stay exact)."""
    return x if fmt == "float32" else quantize(x, fmt)


@dataclass
class DenseCache:
    x: np.ndarray
    z: np.ndarray
    a: np.ndarray
    mask: np.ndarray | None


def dense_forward(layer: LayerSpec, x: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                  mask: np.ndarray | None, fmt: str = "float32") -> tuple[np.ndarray, DenseCache]:
    x = _rounded(x, fmt)   # kept rounded: the weight gradient's matmul takes the same input
    z = x @ _rounded(weight, fmt)
    z += _rounded(bias, fmt)
    a = activate(layer.activation, z)
    out = a * mask if mask is not None else a
    return out, DenseCache(x, z, a, mask)


def dense_backward(layer: LayerSpec, dout: np.ndarray, cache: DenseCache, weight: np.ndarray,
                   need_dx: bool = True, fmt: str = "float32"):
    """Returns (dx or None, {"weight": dW, "bias": db}); the gradients in `fmt`'s values."""
    if cache.mask is not None:
        dout = dout * cache.mask
    dz = dout * activation_grad(layer.activation, cache.z, cache.a) if layer.activation != "none" else dout
    dz_in = _rounded(dz, fmt)
    grads = {"weight": _rounded(cache.x.T @ dz_in, fmt), "bias": _rounded(dz.sum(axis=0), fmt)}
    dx = dz_in @ _rounded(weight, fmt).T if need_dx else None
    return dx, grads


# ---------------------------------------------------------------- loss

def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, global_batch: int):
    """Returns (sum of per-sample losses / global_batch, dlogits, number correct)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    denom = exp.sum(axis=1, keepdims=True)
    log_probs = shifted - np.log(denom)
    rows = np.arange(len(labels))
    loss = -log_probs[rows, labels].astype(np.float64).sum() / global_batch
    dlogits = exp / denom
    dlogits[rows, labels] -= 1.0
    dlogits /= np.float32(global_batch)
    correct = int((logits.argmax(axis=1) == labels).sum())
    return float(loss), dlogits.astype(np.float32, copy=False), correct


# ---------------------------------------------------------------- one shard, whole model

@dataclass
class ShardContext:
    """Where a shard sits in the global batch of one step (for dropout masks)."""
    seed: int
    step: int
    global_batch: int
    rows: slice
    train: bool


def layer_forward(spec: ModelSpec, index: int, x: np.ndarray, weights: dict, ctx: ShardContext):
    layer = spec.layers[index]
    mask = None
    if ctx.train and layer.dropout > 0:
        mask = dropout_mask(ctx.seed, ctx.step, index, ctx.global_batch, layer.out_features,
                            ctx.rows, layer.dropout)
    return dense_forward(layer, x, weights["weight"], weights["bias"], mask, spec.precision)


def layer_backward(spec: ModelSpec, index: int, delta: np.ndarray, cache, weights: dict):
    """(delta for the layer below or None for the first layer, this layer's weight gradients)."""
    return dense_backward(spec.layers[index], delta, cache, weights["weight"], need_dx=index > 0,
                          fmt=spec.precision)


def model_forward(spec: ModelSpec, x: np.ndarray, weights: dict, ctx: ShardContext):
    """Every layer in order, on weights held in this process: (logits, caches)."""
    caches = []
    for index, layer in enumerate(spec.layers):
        x, cache = layer_forward(spec, index, x, weights[layer.name], ctx)
        caches.append(cache)
    return x, caches


def model_backward(spec: ModelSpec, delta: np.ndarray, caches: list, weights: dict) -> list[dict]:
    """Every layer in reverse: the weight gradients of each layer, in layer order."""
    grads: list = [None] * len(spec.layers)
    for index in reversed(range(len(spec.layers))):
        delta, grads[index] = layer_backward(spec, index, delta, caches[index], weights[spec.layers[index].name])
    return grads
