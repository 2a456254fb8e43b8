"""The weights of this project's models under the names and layout a torch module uses.

The model zoo's PyTorch modules name the same weights differently and keep a
linear layer's matrix as torch does, (out, in), where this project keeps
(in, out) so that y = x @ W. One table per model maps each torch name to
(layer, parameter, how):

- "same": the array as it is (embeddings, biases, layer-norm gains);
- "T": transposed (linear layers' matrices);
- ("qkv", k): the k-th third (query, key, value) of the packed attention
  projection, transposed where it is a matrix: the model zoo's attention has
  three separate linear layers, this project one of three times the width.

The names are the model zoo's modules' `state_dict()` names: FC-MNIST's
`MNIST` (fc_layers.N, last_layer), GPT-2's `GPT2LMHeadModel` (embedding_layer,
transformer_decoder.layers.N, lm_head; its final norm is registered twice, as
`ln_f` and `transformer_decoder.norm`, and both names are written), BERT's
`BertPretrainModel` (bert_encoder, bert_mlm_head; without disable_nsp also the
segment embeddings, bert_encoder.pooler and bert_cls_head). A compiled
program (a captured torch module) already uses its module's names and layout.

A tied head (share_embedding_weights) has no decoder matrix of its own: the
model zoo's module registers the word embeddings a second time as the output
layer's weight (`lm_head.weight`, BERT's classifier weight), in the same
(vocab, width) layout, so that name is an alias of the embedding's, written
both ways and checked equal when read. GPT-2's decoder bias is there only
with use_bias_in_output.

The same mapping serves the optimizer state: each slot of a parameter goes
where the parameter goes (Adam's scalar step count to each third alike).
No torch here: arrays are numpy, so the core never imports torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from cs_runtime.errors import UserInputError

FAMILIES = ("fc_mnist", "gpt2", "bert", "program")
NSP_SEGMENTS = "bert_encoder.embedding_layer.segment_embeddings.weight"   # BERT with its next-sentence head


class NameMapError(UserInputError):
    """Weights and a torch naming that do not fit; the message names the weights."""


@dataclass(frozen=True)
class Entry:
    torch_name: str
    layer: str
    param: str
    how: object = "same"      # "same", "T" or ("qkv", k)


def _linear(prefix: str, layer: str, param: str) -> list[Entry]:
    """A torch nn.Linear at `prefix` holding this project's `<param>weight` / `<param>bias`."""
    return [Entry(f"{prefix}.weight", layer, f"{param}weight", "T"), Entry(f"{prefix}.bias", layer, f"{param}bias")]


def _norm(prefix: str, layer: str, param: str) -> list[Entry]:
    return [Entry(f"{prefix}.weight", layer, f"{param}gain"), Entry(f"{prefix}.bias", layer, f"{param}bias")]


def _block(prefix: str, layer: str, second_norm: str) -> list[Entry]:
    entries = []
    for k, which in enumerate("qkv"):
        entries += [Entry(f"{prefix}.self_attn.proj_{which}_dense_layer.weight", layer, "qkv_weight", ("qkv", k)),
                    Entry(f"{prefix}.self_attn.proj_{which}_dense_layer.bias", layer, "qkv_bias", ("qkv", k))]
    return (entries + _linear(f"{prefix}.self_attn.proj_output_dense_layer", layer, "proj_")
            + _norm(f"{prefix}.norm1", layer, "ln1_") + _norm(f"{prefix}.{second_norm}", layer, "ln2_")
            + _linear(f"{prefix}.ffn.ffn.0.linear_layer", layer, "fc_")
            + _linear(f"{prefix}.ffn.ffn.1.linear_layer", layer, "out_"))


def _decoder(prefix: str, embedding: str, tied: bool, out_bias: bool) -> tuple[list[Entry], dict[str, str]]:
    """The head's output layer at `prefix`: its own matrix, or (tied) the embedding's under a second name."""
    table = [] if tied else [Entry(f"{prefix}.weight", "lm_head", "decoder_weight", "T")]
    if out_bias:
        table.append(Entry(f"{prefix}.bias", "lm_head", "decoder_bias"))
    return table, ({f"{prefix}.weight": embedding} if tied else {})


# The output layer of each language model's head, and its token embedding (the name a tied head shares).
DECODERS = {"gpt2": ("lm_head", "embedding_layer.word_embeddings.weight"),
            "bert": ("bert_mlm_head.classifier.ffn.0.linear_layer",
                     "bert_encoder.embedding_layer.word_embeddings.weight")}


def entries(family: str, count: int, tied: bool = False, out_bias: bool = True,
            nsp: bool = False) -> tuple[list[Entry], dict[str, str]]:
    """(the table, aliases: a second name -> the table's name of the same tensor).
    `count`: dense layers of an MLP, transformer blocks of GPT-2 / BERT; `tied`, `out_bias`:
    the language model's head (a decoder tied to the token embedding, with a bias)."""
    if family == "fc_mnist":
        table = []
        for i in range(count):
            prefix = "last_layer" if i == count - 1 else f"fc_layers.{i}"
            table += _linear(prefix, f"fc{i}", "")
        return table, {}
    if family == "gpt2":
        table = [Entry("embedding_layer.word_embeddings.weight", "embed", "tokens"),
                 Entry("embedding_layer.position_embeddings.weight", "embed", "positions")]
        for i in range(count):
            table += _block(f"transformer_decoder.layers.{i}", f"block{i}", "norm3")
        head, tied_alias = _decoder(*DECODERS["gpt2"], tied, out_bias)
        table += _norm("transformer_decoder.norm", "lm_head", "ln_") + head
        return table, {"ln_f.weight": "transformer_decoder.norm.weight", "ln_f.bias": "transformer_decoder.norm.bias",
                       **tied_alias}
    if family == "bert":
        table = [Entry("bert_encoder.embedding_layer.word_embeddings.weight", "embed", "tokens"),
                 Entry("bert_encoder.embedding_layer.position_embeddings.weight", "embed", "positions"),
                 *_norm("bert_encoder.embed_ln_f", "embed", "ln_")]
        for i in range(count):
            table += _block(f"bert_encoder.transformer_encoder.layers.{i}", f"block{i}", "norm2")
        head, tied_alias = _decoder(*DECODERS["bert"], tied, out_bias)
        table += (_linear("bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer", "lm_head", "transform_")
                  + _norm("bert_mlm_head.mlm_transform.ln", "lm_head", "ln_") + head)
        if nsp:   # the next-sentence head: segment table, pooler, classifier (BertPretrainModel's names)
            table += [Entry(NSP_SEGMENTS, "embed", "segments"),
                      *_linear("bert_encoder.pooler.pooler.ffn.0.linear_layer", "nsp_head", "pooler_"),
                      *_linear("bert_cls_head.classifier.ffn.0.linear_layer", "nsp_head", "classifier_")]
        return table, tied_alias
    raise NameMapError(f"no torch naming for model family {family!r}; known: {', '.join(FAMILIES[:-1])}")


# ---------------------------------------------------------------- which model

def family_of(model: dict) -> tuple[str, int]:
    """(family, count) of a checkpoint's model description (ModelSpec.describe())."""
    if "units" in model:
        return "program", len(model["units"])
    layers = model.get("layers") or []
    ops = [layer.get("op") for layer in layers]
    if ops and all(op == "dense" for op in ops):
        return "fc_mnist", len(ops)
    blocks = ops.count("transformer_block")
    if ops[-1:] == ["nsp_head"]:
        ops = ops[:-1]
    if ops[:1] == ["embedding"] and ops[-1:] == ["lm_head"] and blocks == len(ops) - 2:
        return ("bert" if layers[0].get("norm") == "post" else "gpt2"), blocks
    raise NameMapError(f"model {model.get('name')!r} (layers {', '.join(map(str, ops))}) has no torch naming here")


_BLOCK_INDEX = re.compile(r"\.layers\.(\d+)\.|^fc_layers\.(\d+)\.")


def family_from_names(names) -> tuple[str, int]:
    """(family, count) read off torch names alone (a model-zoo file that carries no model description)."""
    names = list(names)
    indices = [int(a or b) for m in map(_BLOCK_INDEX.search, names) if m for a, b in [m.groups()]]
    count = max(indices) + 1 if indices else 0
    if any(n.startswith("bert_encoder.") for n in names):
        return "bert", count
    if any(n.startswith("transformer_decoder.") or n.startswith("embedding_layer.") for n in names):
        return "gpt2", count
    if any(n.startswith("last_layer.") for n in names):
        return "fc_mnist", count + 1
    shown = ", ".join(sorted(names)[:4]) or "none"
    raise NameMapError(f"weights named {shown}... are not of a model this project names (FC-MNIST, GPT-2, BERT)")


# ---------------------------------------------------------------- the arrays

def _out(array: np.ndarray, how) -> np.ndarray:
    if how == "T":
        return np.ascontiguousarray(array.T) if array.ndim == 2 else array.copy()
    if isinstance(how, tuple):
        if array.ndim == 0:   # a scalar slot (Adam's step): the same for each third
            return array.copy()
        part = np.split(array, 3, axis=-1)[how[1]]
        return np.ascontiguousarray(part.T if part.ndim == 2 else part)
    return array.copy()


def _back(parts: list[tuple[object, np.ndarray]]) -> np.ndarray:
    """The project's array from its torch piece(s)."""
    how, array = parts[0]
    if how == "T":
        return np.ascontiguousarray(array.T) if array.ndim == 2 else array.copy()
    if isinstance(how, tuple):
        thirds = [a for _, a in sorted(parts, key=lambda p: p[0][1])]
        if thirds[0].ndim == 0:
            return thirds[0].copy()
        return np.concatenate([t.T if t.ndim == 2 else t for t in thirds], axis=-1)
    return array.copy()


def to_torch(table: list[Entry], aliases: dict[str, str], arrays: dict[str, dict[str, np.ndarray]],
             missing_ok: bool = False) -> dict[str, np.ndarray]:
    """{torch name: array} from {layer: {param: array}} (weights, or one slot of the optimizer state).
    `missing_ok`: leave out what `arrays` lacks (a slot not every parameter has)."""
    out = {}
    for e in table:
        value = arrays.get(e.layer, {}).get(e.param)
        if value is None:
            if missing_ok:
                continue
            raise NameMapError(f"weights {e.layer}/{e.param} missing (the torch name {e.torch_name} needs them)")
        out[e.torch_name] = _out(np.asarray(value), e.how)
    for alias, name in aliases.items():
        if name in out:
            out[alias] = out[name]
    return out


def from_torch(table: list[Entry], aliases: dict[str, str], tensors: dict[str, np.ndarray], what: str,
               missing_ok: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """{layer: {param: array}} from {torch name: array}; every name of the table there
    (unless `missing_ok`), none other (one NameMapError naming them, `what` says whose)."""
    known = {e.torch_name for e in table}
    for alias, name in aliases.items():
        if alias in tensors and name in tensors and not np.array_equal(tensors[alias], tensors[name]):
            raise NameMapError(f"{what}: {alias} and {name} are one tensor in the model but differ here")
    extra = sorted(n for n in tensors if n not in known and n not in aliases)
    absent = [e.torch_name for e in table if e.torch_name not in tensors and not any(
        a in tensors for a, n in aliases.items() if n == e.torch_name)]
    if extra or (absent and not missing_ok):
        problems = ([f"no place in the model for {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"]
                    if extra else [])
        if absent and not missing_ok:
            problems.append(f"missing {', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}")
        raise NameMapError(f"{what}: {'; '.join(problems)}")
    by_name = dict(tensors)
    for alias, name in aliases.items():
        if name not in by_name and alias in by_name:
            by_name[name] = by_name[alias]
    grouped: dict[tuple[str, str], list] = {}
    for e in table:
        if e.torch_name in by_name:
            grouped.setdefault((e.layer, e.param), []).append((e.how, np.asarray(by_name[e.torch_name])))
    out: dict[str, dict[str, np.ndarray]] = {}
    for (layer, param), parts in grouped.items():
        out.setdefault(layer, {})[param] = _back(parts)
    return out


def program_entries(model: dict) -> tuple[list[Entry], dict[str, str]]:
    """A compiled program: its units' parameters keep their torch names and layout."""
    return [Entry(p, unit["name"], p) for unit in model["units"] for p in unit["params"]], {}


def family_from_weights(weights: dict) -> tuple[str, int]:
    """(family, count) read off this project's layer names (a checkpoint with no model description)."""
    layers = list(weights)
    if layers and all(re.fullmatch(r"fc\d+", layer) for layer in layers):
        return "fc_mnist", len(layers)
    if "embed" in weights and "lm_head" in weights:
        blocks = sum(bool(re.fullmatch(r"block\d+", layer)) for layer in layers)
        return ("bert" if "ln_gain" in weights["embed"] else "gpt2"), blocks
    raise NameMapError(f"layers {', '.join(layers[:4])}... are not of a model with a torch naming here "
                       "(FC-MNIST, GPT-2, BERT) and the checkpoint carries no model description")


def head_of(model: dict) -> dict:
    """{tied, out_bias, nsp} of a described language model's head (ModelSpec.describe())."""
    layers = model.get("layers") or [{}]
    nsp = layers[-1].get("op") == "nsp_head"
    head = layers[-2] if nsp else layers[-1]
    return {"tied": bool(head.get("tied", "")), "out_bias": bool(head.get("out_bias", True)), "nsp": nsp}


def head_from_weights(weights: dict) -> dict:
    head = weights.get("lm_head", {})
    return {"tied": "decoder_weight" not in head, "out_bias": "decoder_bias" in head, "nsp": "nsp_head" in weights}


def head_from_names(family: str, tensors) -> dict:
    """A model-zoo state_dict: tied when the output layer's weight is absent or is the word
    embeddings (its module writes the one tensor under both names); a bias when there is one."""
    if family not in DECODERS:
        return {}
    prefix, embedding = DECODERS[family]
    weight = f"{prefix}.weight"
    tied = weight not in tensors or (isinstance(tensors, dict) and embedding in tensors and np.array_equal(
        np.asarray(tensors[weight]), np.asarray(tensors[embedding])))
    return {"tied": tied, "out_bias": f"{prefix}.bias" in tensors, "nsp": family == "bert" and NSP_SEGMENTS in tensors}


def table_for(model: dict | None, names=None, weights: dict | None = None) -> tuple[list[Entry], dict[str, str]]:
    """The table of a model description, else of torch `names` (a dict of tensors: their
    values tell a tied head), else of the project's `weights`."""
    if model:
        family, count = family_of(model)
        if family == "program":
            return program_entries(model)
        return entries(family, count, **(head_of(model) if family in DECODERS else {}))
    if weights is not None:
        family, count = family_from_weights(weights)
        return entries(family, count, **(head_from_weights(weights) if family in DECODERS else {}))
    family, count = family_from_names(names or [])
    return entries(family, count, **head_from_names(family, names or []))


def parameter_order(table: list[Entry]) -> list[str]:
    """Torch names in the module's parameters() order (the optimizer state's indices)."""
    return [e.torch_name for e in table]
