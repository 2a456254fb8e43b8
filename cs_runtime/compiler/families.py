"""The built-in model families (params.yaml's FC-MNIST, GPT-2, BERT) lowered
to the program a captured model gives: ops of ops.py, the loss included,
the backward from autodiff.py, cut into units by units.py.

    spec = lower_spec(mlp_spec("fc_mnist", [784, 256, 10], "relu", 0.1))
    spec.layers[0].unit["unit"]            # unit fc0, as data: what every path runs

Each LayerSpec becomes one unit (its ops carry the layer's name as their
module path, so the unit rule cuts the program exactly at the layers) and
keeps everything it had: its op, sizes and parameter names, so weight
initialisation (model.init_weights) and checkpoints (`model/fc0/weight`) stay
as they were. A unit's parameters are
named `<layer>.<param>` inside the program; `unit["local"]` maps them back.

What the hand-written layers did, op by op:
- dense: matmul(x, W[in, out]) + b, the activation, dropout;
- embedding: token rows + the first T position rows [+ layer norm], dropout;
  the padding keys (ids == pad_id) are a value the blocks' attention reads;
- transformer_block: pre-norm (GPT-2) or post-norm (BERT) attention and GELU
  MLP with residuals; attention is one op (self_attention) on the packed q/k/v;
- lm_head: [dense + GELU (BERT's transform)] + layer norm + decoder [+ bias];
  tied (share_embedding_weights), the decoder is linear(h, embed.tokens): the
  one program parameter both units read, which each layer holds a copy of
  under its own name (`tokens`); then the summed token cross-entropy;
- nsp_head (BERT unless disable_nsp): pooler + classifier on the encoder's
  first token and the summed next-sentence cross-entropy, a second loss value
  the runner weights 1 / global batch (the embedding then adds segment rows);
- a classifier's loss: the op softmax_cross_entropy (the dense layers' kernel:
  its share of the global batch's mean, the gradient divided by the global
  batch), so a 16-bit FC-MNIST rounds as the dense layers did, to the bit.
Dropout masks come from the op dropout_mask, fed the run's context (seed,
step, the shard's rows, global batch, train/eval): the masks of the
hand-written layers, bit for bit. A token model's loss is a sum the runner
weights (the token loss scaling); a classifier's is weighted already; so shards add up.
"""
from __future__ import annotations

import dataclasses

from cs_runtime.compiler.errors import CompileError
from cs_runtime.compiler.units import split_units
from cs_runtime.numerics import kernels
from cs_runtime.numerics.model import GELU_KINDS, ModelSpec
from cs_runtime.numerics.program import Node, Program, Value, infer_values
from cs_runtime.numerics.transformer_params import NSP_FEATURES

CONTEXT = "dropout_context"   # int64 [seed, step, row_start, row_stop, global_batch, train]
INPUT, LABELS, LOSS, LOGITS = "x", "labels", "loss", "logits"
# BERT's next-sentence head: its inputs (features of a batch besides the token ids) and loss
_, SEGMENTS, NSP_LABELS = NSP_FEATURES
NSP_LOSS, NSP_LOGITS = "nsp_loss", "nsp_logits"
PAD_KEYS = "embed:key_keep"
ACTIVATION_OPS = {"relu": ("relu", {}), "tanh": ("tanh", {}), "sigmoid": ("sigmoid", {}),
                  "gelu": ("gelu", {}), "gelu_new": ("gelu", {"approximate": "tanh"}),
                  "gelu_tanh": ("gelu", {"approximate": "tanh"})}


def program_name(layer, pname: str) -> str:
    """The program's name of a layer's parameter: `<layer>.<param>`, but a tied head's
    copy of the token table is the embedding's own parameter (one, read by both units)."""
    if layer.op == "lm_head" and layer.tied and pname == "tokens":
        return f"{layer.tied}.tokens"
    return f"{layer.name}.{pname}"


class _Builder:
    """Appends nodes of one layer (its module path) with fresh value names."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.params: dict[str, Value] = {}
        self.local: dict[str, dict[str, str]] = {}
        self.module = ""

    def layer(self, layer) -> None:
        self.module = layer.name
        self.local[layer.name] = {}
        for pname, shape in layer.param_shapes().items():
            full = program_name(layer, pname)
            self.params[full] = Value(tuple(shape))
            self.local[layer.name][full] = pname

    def param(self, pname: str) -> str:
        return f"{self.module}.{pname}"

    def op(self, op: str, *inputs: str, out: str | None = None, **attrs) -> str:
        name = out or f"{self.module}:{len(self.nodes)}:{op}"
        self.nodes.append(Node(op, tuple(inputs), (name,), attrs, self.module))
        return name

    def dense(self, x: str, weight: str, bias: str) -> str:
        return self.op("add", self.op("matmul", x, self.param(weight)), self.param(bias))

    def activation(self, kind: str, x: str) -> str:
        if kind == "none":
            return x
        op, attrs = ACTIVATION_OPS[kind]
        return self.op(op, x, **attrs)

    def dropout(self, x: str, p: float, index: int, kind: str, site: int = 0) -> str:
        if p <= 0:
            return x
        mask = self.op("dropout_mask", x, CONTEXT, p=float(p), kind=kind, layer=index, site=site)
        return self.op("dropout", x, mask, p=float(p))

    def layer_norm(self, x: str, gain: str, bias: str, layer) -> str:
        return self.op("layer_norm", x, self.param(gain), self.param(bias),
                       normalized_shape=[layer.in_features if layer.op != "embedding" else layer.out_features],
                       eps=float(layer.eps))


# ---------------------------------------------------------------- one layer each

def _dense(b: _Builder, layer, index: int, x: str, spec: ModelSpec) -> str:
    h = b.activation(layer.activation, b.dense(x, "weight", "bias"))
    return b.dropout(h, layer.dropout, index, "rows")


def _embedding(b: _Builder, layer, index: int, ids: str, spec: ModelSpec) -> str:
    h = b.op("add", b.op("embedding", b.param("tokens"), ids), b.op("position_embedding", b.param("positions"), ids))
    if layer.segments:   # BERT with its next-sentence head: + the segment (token type) rows
        h = b.op("add", h, b.op("embedding", b.param("segments"), SEGMENTS))
    if layer.norm == "post":
        h = b.layer_norm(h, "ln_gain", "ln_bias", layer)
    if layer.pad_id >= 0:
        b.op("compare", ids, out=PAD_KEYS, cmp="ne", scalar=int(layer.pad_id))
    return b.dropout(h, layer.dropout, index, "hash", 0)


def _attention(b: _Builder, layer, index: int, x: str, keep: bool) -> str:
    qkv = b.dense(x, "qkv_weight", "qkv_bias")
    inputs, attrs = [qkv], {"heads": layer.num_heads, "causal": bool(layer.causal)}
    if keep:
        inputs.append(PAD_KEYS)
        attrs["key_keep"] = True
    if layer.attn_dropout > 0:
        inputs.append(b.op("dropout_mask", qkv, CONTEXT, p=float(layer.attn_dropout), kind="hash", layer=index,
                           site=0, heads=layer.num_heads))
        attrs["drop"] = True
    att = b.op("self_attention", *inputs, **attrs)
    return b.dropout(b.dense(att, "proj_weight", "proj_bias"), layer.dropout, index, "hash", 1)


def _mlp(b: _Builder, layer, index: int, x: str) -> str:
    act = b.activation(layer.activation, b.dense(x, "fc_weight", "fc_bias"))
    return b.dropout(b.dense(act, "out_weight", "out_bias"), layer.dropout, index, "hash", 2)


def _block(b: _Builder, layer, index: int, x: str, spec: ModelSpec) -> str:
    if layer.activation not in GELU_KINDS:
        raise CompileError(f"layer {layer.name} ({layer.op}): activation {layer.activation!r} is not one of "
                         f"{', '.join(GELU_KINDS)}")
    keep = spec.layers[0].pad_id >= 0
    if layer.norm == "pre":   # GPT-2: x + f(LN(x))
        h = b.op("add", x, _attention(b, layer, index, b.layer_norm(x, "ln1_gain", "ln1_bias", layer), keep))
        return b.op("add", h, _mlp(b, layer, index, b.layer_norm(h, "ln2_gain", "ln2_bias", layer)))
    # BERT: LN(x + f(x))
    h = b.layer_norm(b.op("add", x, _attention(b, layer, index, x, keep)), "ln1_gain", "ln1_bias", layer)
    return b.layer_norm(b.op("add", h, _mlp(b, layer, index, h)), "ln2_gain", "ln2_bias", layer)


def _head(b: _Builder, layer, index: int, x: str, spec: ModelSpec) -> str:
    h = x
    if layer.activation != "none":   # BERT's MLM transform
        h = b.activation(layer.activation, b.dense(x, "transform_weight", "transform_bias"))
    h = b.layer_norm(h, "ln_gain", "ln_bias", layer)
    bias = (b.param("decoder_bias"),) if layer.out_bias else ()
    if layer.tied:   # logits = h @ tokens^T (+ b): torch's linear, the table in its (vocab, width) layout
        return b.op("linear", h, program_name(layer, "tokens"), *bias)
    logits = b.op("matmul", h, b.param("decoder_weight"))
    return b.op("add", logits, *bias) if bias else logits


def _nsp_head(b: _Builder, layer, index: int, encoded: str) -> str:
    """BERT's pooler (dense + its nonlinearity on the first token's final hidden state) and
    the next-sentence classifier, then their summed cross-entropy (the runner weights it
    1 / global batch: the model zoo's mean over the batch's sequences)."""
    first = b.op("reshape", b.op("slice", encoded, dim=1, start=0, end=1), shape=[-1, layer.in_features])
    pooled = b.activation(layer.activation, b.dense(first, "pooler_weight", "pooler_bias"))
    logits = b.op("add", b.op("matmul", pooled, b.param("classifier_weight")), b.param("classifier_bias"),
                  out=NSP_LOGITS)
    return b.op("cross_entropy", logits, NSP_LABELS, out=NSP_LOSS, reduction="sum",
                ignore_index=kernels.IGNORE_INDEX)


LAYERS = {"dense": _dense, "embedding": _embedding, "transformer_block": _block, "lm_head": _head}


# ---------------------------------------------------------------- checks, before anything is built

def check_layer(layer) -> None:
    """A layer's settings, each problem one CompileError naming the layer and its op."""
    where = f"layer {layer.name} (op {layer.op})"
    if layer.op not in LAYERS and layer.op != "nsp_head":
        raise CompileError(f"{where}: unsupported op {layer.op!r}; supported: {', '.join([*LAYERS, 'nsp_head'])}")
    for what in ("in_features", "out_features"):
        value = getattr(layer, what)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CompileError(f"{where}: {what} {value!r} is not a positive int")
    for what in ("dropout", "attn_dropout"):
        p = getattr(layer, what)
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise CompileError(f"{where}: {what} {p!r} outside [0, 1)")
    if layer.activation not in ACTIVATION_OPS and layer.activation != "none":
        raise CompileError(f"{where}: unsupported activation {layer.activation!r}; supported: "
                           f"{', '.join([*ACTIVATION_OPS, 'none'])}")
    if layer.op == "embedding" and layer.max_len <= 0:
        raise CompileError(f"{where}: max_len {layer.max_len!r} is not a positive int")
    if layer.op == "transformer_block" and (layer.num_heads <= 0 or layer.in_features % layer.num_heads
                                            or layer.ffn_features <= 0):
        raise CompileError(f"{where}: width {layer.in_features} needs num_heads > 0 dividing it "
                           f"(got {layer.num_heads}) and ffn_features > 0 (got {layer.ffn_features})")


def check_model(spec: ModelSpec) -> None:
    if not spec.layers:
        raise CompileError(f"model {spec.name}: has no layers")
    if spec.loss != "softmax_cross_entropy":
        raise CompileError(f"model {spec.name}: unsupported loss {spec.loss!r}; supported: softmax_cross_entropy")
    for layer in spec.layers:
        check_layer(layer)


# ---------------------------------------------------------------- the whole model

def build_program(spec: ModelSpec) -> tuple[Program, dict[str, dict[str, str]]]:
    """The spec's program (forward and summed loss) and, per layer, {program name: param name}."""
    check_model(spec)
    b = _Builder()
    token = spec.token_model
    x = INPUT
    layers = spec.model_layers
    for index, layer in enumerate(layers):
        if layer.op == "lm_head":
            encoded = x
        b.layer(layer)
        x = LAYERS[layer.op](b, layer, index, x, spec)
    # The loss joins the last layer's unit: [B, T, V] logits flattened to tokens and summed
    # (the runner weights the sum), or a classifier's [B, C] scores: its share of the global
    # batch's mean, the gradient divided by the global batch (from the context) as the
    # dense layers' loss divided it, so 16-bit runs round alike to the bit.
    if token:
        logits = b.op("reshape", x, out=LOGITS, shape=[-1, layers[-1].out_features])
        labels = b.op("reshape", LABELS, shape=[-1])
        b.op("cross_entropy", logits, labels, out=LOSS, reduction="sum", ignore_index=kernels.IGNORE_INDEX)
        if nsp_head(spec):   # its own unit after the masked-LM head's, reading the encoder's output
            b.layer(spec.layers[-1])
            _nsp_head(b, spec.layers[-1], len(spec.layers) - 1, encoded)
    else:
        logits = x
        b.op("softmax_cross_entropy", logits, LABELS, CONTEXT, out=LOSS)
    inputs = {INPUT: Value((2, spec.layers[0].max_len) if token else (2, spec.layers[0].in_features),
                           "int64" if token else "float32")}
    outputs = {"loss": LOSS, "logits": logits}
    if nsp_head(spec):
        inputs.update({SEGMENTS: Value((2, spec.layers[0].max_len), "int64"), NSP_LABELS: Value((2,), "int64")})
        outputs.update(nsp_loss=NSP_LOSS, nsp_logits=NSP_LOGITS)
    inputs.update({LABELS: Value((2, spec.layers[0].max_len) if token else (2,), "int64"),
                   CONTEXT: Value((6,), "int64")})
    program = Program(b.params, inputs, {}, b.nodes, outputs).validate()
    return program, b.local


def lower_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with each layer's unit attached (and the program's shared data): what the
    CPU path, the WSE and the pipelined executor run. A spec already a program is returned as it is."""
    if spec.program is not None:
        return spec
    program, local = build_program(spec)
    shapes, dtypes = infer_values(program)
    units = split_units(program, shapes, dtypes)
    names = [u.name for u in units]
    if names != [layer.name for layer in spec.layers]:
        raise ValueError(f"model {spec.name}: lowering cut units {names}, not the layers")
    layers = tuple(dataclasses.replace(layer, unit={"unit": u.to_meta(), "local": local[layer.name]})
                   for layer, u in zip(spec.layers, units))
    shared = {"inputs": [INPUT, LABELS], "context": CONTEXT, "loss": LOSS, "logits": LOGITS if spec.token_model
              else program.outputs["logits"], "reduction": "sum" if spec.token_model else "share", "ignore_index": kernels.IGNORE_INDEX,
              "values": {}, "consts": {}}
    if nsp_head(spec):   # a batch's features by name; the next-sentence loss weighted on its own
        shared.update(inputs=[INPUT, SEGMENTS, NSP_LABELS, LABELS], features=list(NSP_FEATURES), nsp_loss=NSP_LOSS,
                      nsp_logits=NSP_LOGITS)
    return dataclasses.replace(spec, layers=layers, program=shared)


def nsp_head(spec: ModelSpec) -> bool:
    """Whether the spec ends with BERT's next-sentence head (its last layer)."""
    return bool(spec.layers) and spec.layers[-1].op == "nsp_head"
