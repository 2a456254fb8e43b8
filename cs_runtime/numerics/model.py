"""The model: layer specs, weight initialisation, and running it layer by layer.

A model is a list of `LayerSpec`s (one weight-streaming unit each) followed by
its loss. Each layer runs as a unit of a compiled program (program_layer.py,
through numerics/executor.py): a captured torch model's units, or a built-in
layer lowered by cs_runtime/compiler/families.py. Every run lowers its spec
first, in every precision (compiler/stage.py runnable), and nothing else
runs: a layer without its unit is an error here (`not_lowered`). The same
program runs in the CPU oracle and in every WSE emulator, so the maths is
identical by construction; only the rows of the batch (data-parallel shards)
and the summation order of gradients across WSEs differ. The hand-written
dense layer the lowered program equals bit for bit is the tests' reference
(tests/dense_reference.py).

Conventions that make data parallel equal the oracle:
- losses and gradients are scaled by one factor for the whole global batch on
  every shard (1/global_batch; a token model's normaliser, from the global
  batch's label count), so the sum over shards (SwarmX's reduce) is the
  global batch's loss;
- the dropout mask of step s, layer l is a function of (seed, s, l, the
  sample's row in the global batch) (kernels.rows_keep_mask), so a sample gets
  the same mask whichever WSE holds it.

Mixed precision (`ModelSpec.precision` other than float32): every matmul-like
op takes its inputs (activations or deltas, and weights) rounded to the
16-bit format and accumulates in float32; biases are used in the 16-bit
format too (they stream as the weights do), and the weight gradients come
out in the 16-bit format, as a 16-bit matmul on the wafer emits them
(mixed_ops.py). Activation functions, layer norms, softmax, the loss and the
master weights stay float32.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

import numpy as np

from cs_runtime.numerics import blas, kernels, program_layer
from cs_runtime import spans
from cs_runtime.numerics.precision import FORMATS
from cs_runtime.numerics.transformer_params import LAYER_SHAPES, init_param, init_std

ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "gelu_new", "gelu_tanh", "none")
GELU_KINDS = tuple(kernels.GELUS)   # gelu is exact (erf); gelu_new and gelu_tanh the tanh approximation


@dataclass(frozen=True)
class LayerSpec:
    """One weight-streaming unit. "dense": y = act(x @ W + b), then dropout.
    The transformer layers (their parameters: cs_runtime/numerics/transformer_params.py) use the fields after
    `dropout`: "embedding" maps in_features (vocabulary) ids to out_features
    (model width); "transformer_block" keeps the width; "lm_head" maps the
    width to out_features (vocabulary) logits. `activation` of a
    transformer_block is its MLP's GELU; of an lm_head, BERT's transform's
    (none: GPT-2's head has no transform)."""
    name: str
    op: str
    in_features: int
    out_features: int
    activation: str = "none"
    dropout: float = 0.0
    max_len: int = 0             # embedding: number of position embeddings
    num_heads: int = 0           # transformer_block
    ffn_features: int = 0        # transformer_block: width of the MLP
    causal: bool = False         # transformer_block: query i sees keys <= i (GPT)
    norm: str = "pre"            # "pre" (GPT-2) or "post" (BERT) layer norm
    attn_dropout: float = 0.0    # transformer_block: on the attention probabilities
    eps: float = 1e-5            # layer norm epsilon
    pad_id: int = -1             # embedding: token id of padding (-1: none)
    tied: str = ""               # lm_head: the embedding layer whose token table is its decoder, transposed
    out_bias: bool = True        # lm_head: the decoder adds a bias
    segments: int = 0            # embedding: segment (token type) ids it embeds (0: none)
    # "program": one unit of a compiled program, as data (program_layer.py)
    unit: dict | None = field(default=None, compare=False, repr=False)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.op == "program":
            return program_layer.param_shapes(self)
        if self.op in LAYER_SHAPES:
            return LAYER_SHAPES[self.op](self)
        return {"weight": (self.in_features, self.out_features), "bias": (self.out_features,)}

    def num_params(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.param_shapes().values())

    def to_dict(self) -> dict:
        """The fields that differ from their defaults (so a dense layer's dict stays as it was)."""
        defaults = {f.name: f.default for f in fields(self)}  # required fields: MISSING, always kept
        return {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]
                or k in ("activation", "dropout")}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[LayerSpec, ...]
    loss: str = "softmax_cross_entropy"
    precision: str = "float32"   # the format of matmul inputs and weight gradients
    loss_scaling: str = "num_tokens"   # token models: kernels.TOKEN_LOSS_SCALINGS
    loss_weight: float = 1.0           # token models, with loss_scaling batch_size
    # A compiled program's shared data (input names, constants, loss value): program_layer.py
    program: dict | None = field(default=None, compare=False, repr=False)
    # A program's starting weights (a torch module's own); kept in the process that built
    # the spec, never sent: parameter name -> array
    initial_weights: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.loss_scaling not in kernels.TOKEN_LOSS_SCALINGS:
            raise ValueError(f"unknown loss_scaling {self.loss_scaling!r}; expected one of "
                             f"{', '.join(kernels.TOKEN_LOSS_SCALINGS)}")
        if self.precision not in FORMATS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {sorted(FORMATS)}")

    def to_dict(self) -> dict:
        d = {"name": self.name, "loss": self.loss, "precision": self.precision,
             "loss_scaling": self.loss_scaling, "loss_weight": self.loss_weight,
             "layers": [l.to_dict() for l in self.layers]}
        if self.program is not None:
            d["program"] = self.program
        return d

    def describe(self) -> dict:
        """What a checkpoint records of the model (JSON): to_dict, or for a compiled
        program its units' names and parameter shapes (the program is the run's, not the file's)."""
        if not self.captured:   # a built-in model: its layers (a lowered program is the run's)
            return self.plain().to_dict()
        return {"name": self.name, "loss": self.loss, "precision": self.precision,
                "units": [{"name": l.name, "params": {p: list(s) for p, s in l.param_shapes().items()}}
                          for l in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        layers = tuple(LayerSpec(**layer) for layer in d["layers"])
        spec = cls(name=str(d["name"]), layers=layers, loss=str(d.get("loss", "softmax_cross_entropy")),
                   precision=str(d.get("precision", "float32")), program=d.get("program"),
                   loss_scaling=str(d.get("loss_scaling", "num_tokens")), loss_weight=float(d.get("loss_weight", 1.0)))
        if spec.program is not None:
            program_layer.check(spec)   # validated as it arrives, before any step
        return spec

    @property
    def captured(self) -> bool:
        """A compiled program whose layers are its units (a captured torch model), not built-in layers."""
        return any(layer.op == "program" for layer in self.layers)

    def plain(self) -> "ModelSpec":
        """A built-in model's spec without its lowered program (what params.yaml describes)."""
        if self.captured or self.program is None:
            return self
        return replace(self, program=None, layers=tuple(replace(l, unit=None) for l in self.layers))

    @property
    def model_layers(self) -> tuple[LayerSpec, ...]:
        """The layers up to the output head, without BERT's next-sentence head (always the
        last layer when there is one): the masked-LM head is then the last of them."""
        return tuple(layer for layer in self.layers if layer.op != "nsp_head")

    @property
    def token_model(self) -> bool:
        """Input is token ids and the loss is per token (the model starts with an embedding)."""
        return bool(self.layers) and self.layers[0].op == "embedding"

    def num_params(self) -> int:
        """Each parameter once: a tied head's copy of the token table is not another parameter."""
        return sum(layer.num_params() for layer in self.layers) - sum(
            int(np.prod(l.param_shapes()["tokens"])) for l in self.layers if l.op == "lm_head" and l.tied)


def mlp_spec(name: str, sizes: list[int], activation: str, dropout: float) -> ModelSpec:
    """A fully connected classifier: hidden layers get activation + dropout, the last neither."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layers.append(LayerSpec(f"fc{i}", "dense", n_in, n_out,
                                activation="none" if last else activation,
                                dropout=0.0 if last else dropout))
    return ModelSpec(name, tuple(layers))


def transformer_spec(name: str, *, style: str, vocab_size: int, max_len: int, hidden_size: int,
                     num_layers: int, num_heads: int, ffn_features: int, dropout: float, attn_dropout: float,
                     eps: float, pad_id: int = -1, activation: str | None = None,
                     loss_scaling: str | None = None, loss_weight: float = 1.0, tied: bool = False,
                     out_bias: bool = True, nsp: bool = False, num_segments: int = 2,
                     pooler_activation: str = "tanh") -> ModelSpec:
    """GPT-2 (style "gpt2": causal, pre-norm) or BERT (style "bert": bidirectional,
    post-norm, padding mask, MLM transform in the head): embedding, blocks, head.

    `activation`: the GELU of the MLPs (and BERT's head transform); by default
    what each reference uses: gelu_new (tanh) for GPT-2, gelu (exact erf) for
    BERT, as in HF transformers and the model zoo.

    `loss_scaling` / `loss_weight`: the loss's normaliser (kernels.TOKEN_LOSS_SCALINGS);
    by default the model zoo's: num_tokens for GPT-2, batch_size (times
    loss_weight, the model zoo's mlm_loss_weight) for BERT.

    `tied`: the head's decoder is the token embedding, transposed (the model
    zoo's share_embedding_weights); `out_bias`: the decoder adds a bias.

    `nsp` (BERT): the next-sentence head, as the model zoo's BertPretrainModel
    without disable_nsp: `num_segments` segment embeddings in the embedding, and a
    last layer "nsp_head" (pooler with `pooler_activation`, then a 2-way classifier)."""
    if style not in ("gpt2", "bert"):
        raise ValueError(f"unknown transformer style {style!r}; expected gpt2 or bert")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    gpt = style == "gpt2"
    activation = activation or ("gelu_new" if gpt else "gelu")
    if activation not in GELU_KINDS:
        raise ValueError(f"transformer activation {activation!r} is not one of {', '.join(GELU_KINDS)}")
    norm = "pre" if gpt else "post"
    layers = [LayerSpec("embed", "embedding", vocab_size, hidden_size, dropout=dropout, max_len=max_len,
                        norm=norm, eps=eps, pad_id=pad_id, segments=num_segments if nsp else 0)]
    for i in range(num_layers):
        layers.append(LayerSpec(f"block{i}", "transformer_block", hidden_size, hidden_size, activation, dropout,
                                num_heads=num_heads, ffn_features=ffn_features, causal=gpt, norm=norm,
                                attn_dropout=attn_dropout, eps=eps))
    layers.append(LayerSpec("lm_head", "lm_head", hidden_size, vocab_size, activation="none" if gpt else activation,
                            eps=eps, tied="embed" if tied else "", out_bias=bool(out_bias)))
    if nsp:
        if gpt:
            raise ValueError("the next-sentence head is BERT's (style bert)")
        layers.append(LayerSpec("nsp_head", "nsp_head", hidden_size, 2, activation=pooler_activation))
    return ModelSpec(name, tuple(layers), loss_scaling=loss_scaling or ("num_tokens" if gpt else "batch_size"),
                     loss_weight=float(loss_weight))


def init_weights(spec: ModelSpec, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Dense: PyTorch-style uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); transformer layers:
    GPT-2/BERT style (transformer.init_param; GPT-2 scales its residual projections by
    1/sqrt(2 n_layer), transformer.init_std). Deterministic in seed."""
    weights = {}
    if spec.captured:   # a captured model starts from its own (torch's) weights
        if spec.initial_weights is None:
            raise ValueError(f"model {spec.name}: a compiled program's spec carries no initial weights here")
        return {layer.name: {p: np.array(spec.initial_weights[p], dtype=np.float32) for p in layer.param_shapes()}
                for layer in spec.layers}
    num_blocks = sum(layer.op == "transformer_block" for layer in spec.layers)
    for i, layer in enumerate(spec.layers):
        rng = np.random.default_rng([seed, 7919, i])
        if layer.op in LAYER_SHAPES:
            weights[layer.name] = {name: init_param(name, shape, rng, init_std(layer, name, num_blocks))
                                   for name, shape in layer.param_shapes().items()}
            continue
        bound = 1.0 / np.sqrt(layer.in_features)
        weights[layer.name] = {
            name: rng.uniform(-bound, bound, size=shape).astype(np.float32)
            for name, shape in layer.param_shapes().items()
        }
    for layer in spec.layers:   # a tied head starts from (a copy of) the table it shares
        if layer.op == "lm_head" and layer.tied:
            weights[layer.name]["tokens"] = weights[layer.tied]["tokens"].copy()
    return weights


# ---------------------------------------------------------------- one shard, whole model

@dataclass
class ShardContext:
    """Where a shard sits in the global batch of one step (for dropout masks)."""
    seed: int
    step: int
    global_batch: int
    rows: slice
    train: bool
    # Set by an embedding layer from the token ids: False for padding keys,
    # which no attention in the layers after it may attend to.
    key_keep: np.ndarray | None = field(default=None, repr=False)
    # This shard's labels: a compiled program computes its loss in its last unit.
    labels: np.ndarray | None = field(default=None, repr=False)
    # Sums a float64 vector over every shard of the step, in rank order, and returns the sum:
    # a synchronized batch norm's statistics (ops.Op.collective). None: this shard is the
    # whole batch (the CPU path, one WSE), or its statistics are its own.
    reduce: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False, compare=False)


def not_lowered(spec: ModelSpec, layer: LayerSpec | None = None) -> ValueError:
    what = f"layer {layer.name} (op {layer.op})" if layer is not None else "its loss"
    return ValueError(f"model {spec.name}: {what} runs as a compiled program; "
                      f"lower the spec first (cs_runtime.compiler.families.lower_spec)")


def blas_threads(spec: ModelSpec, layer: LayerSpec, batch):
    """A layer's matrix products on the BLAS thread count numerics/blas.py's rule gives
    them (the same on every path, so the same shapes give the same bits): a dense layer's
    by their size, any other layer's on one thread. `batch`: the batch's input, or a
    program's live values (which hold it)."""
    if layer.op != "dense":
        return blas.unit_threads()
    if isinstance(batch, dict):
        batch = batch[spec.program["inputs"][0]]
    rows = batch.size // batch.shape[-1] if batch.ndim > 1 else len(batch)   # [..., features]: every row
    return blas.dense_layer_threads(rows, layer.in_features, layer.out_features)


def lowered(spec: ModelSpec, index: int) -> LayerSpec:
    """The layer, which must be a unit of a compiled program: nothing else runs."""
    layer = spec.layers[index]
    if layer.unit is None:
        raise not_lowered(spec, layer)
    return layer


def layer_forward(spec: ModelSpec, index: int, x, weights: dict, ctx: ShardContext,
                  weights_rounded: bool = False):
    """(output, cache). `x`: the batch's input at the first layer, the program's live
    values after it. `weights_rounded`: the weights hold the model's 16-bit values already."""
    with blas_threads(spec, lowered(spec, index), x):
        return program_layer.forward(spec, index, x, weights, ctx, weights_rounded)


def model_forward(spec: ModelSpec, x: np.ndarray, weights: dict, ctx: ShardContext):
    """Every layer in order, on weights held in this process: (logits, caches)."""
    caches = []
    name = "fwd" if ctx.train else "eval_fwd"
    for index, layer in enumerate(spec.layers):
        with spans.span(name, step=ctx.step, layer=index):
            x, cache = layer_forward(spec, index, x, weights[layer.name], ctx)
        caches.append(cache)
    return x, caches


def layer_backward(spec: ModelSpec, index: int, delta, cache, weights: dict,
                   weights_rounded: bool = False, grads_on_wire: bool = False):
    """(delta for the layer below or None for the first layer, {param: gradient});
    with `grads_on_wire` the gradients come in the format's storage, as a WSE sends them."""
    with blas_threads(spec, lowered(spec, index), cache[1]):   # cache: (the unit's, the live values, the reduce)
        return program_layer.backward(spec, index, delta, cache, weights, weights_rounded, grads_on_wire)


def model_backward(spec: ModelSpec, delta: np.ndarray, caches: list, weights: dict, step: int = -1) -> list[dict]:
    """Every layer in reverse: the weight gradients of each layer, in layer order."""
    grads: list = [None] * len(spec.layers)
    for index in reversed(range(len(spec.layers))):
        with spans.span("bwd", step=step, layer=index):
            delta, grads[index] = layer_backward(spec, index, delta, caches[index],
                                                 weights[spec.layers[index].name])
    return program_layer.tie_grads(spec, grads)


@dataclass
class LossResult:
    loss: float          # this shard's share of the global mean (shards sum to it)
    delta: np.ndarray    # d loss / d logits
    correct: int         # predictions equal to the label (counted tokens for token models)
    loss_sum: float      # summed per-sample (classifier) or per-token loss, for eval
    count: int           # samples or counted tokens behind loss_sum


def model_loss(spec: ModelSpec, logits: np.ndarray, labels: np.ndarray, global_batch: int,
               label_count: int | None = None) -> LossResult:
    """The model's loss on one shard, which the program's last unit computed (`logits`:
    its live values): the mean over samples for a classifier; for a token model the
    labelled tokens' summed loss normalised as `spec.loss_scaling` says (`label_count`:
    labelled tokens in the global batch). Eval reports the mean per sample, or per
    labelled token (program_layer.loss)."""
    if spec.program is None:
        raise not_lowered(spec)
    share, delta, loss_sum, correct, count = program_layer.loss(spec, logits, labels, global_batch, label_count)
    return LossResult(share, delta, correct, loss_sum, count)
