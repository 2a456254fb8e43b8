"""params.yaml: loading and validation of a model-zoo style run configuration.

A Cerebras model-zoo run is described by one YAML file with a section per
concern (``train_input``, ``eval_input``, ``model``, ``optimizer``,
``runconfig``). Every process of the emulated cluster reads the same file, so
it is validated once, strictly, here: an unknown key is a typo, and a string
where a number goes is a mistake, never something to coerce.

    from cs_runtime.config import load_params
    params = load_params("examples/fc_mnist/configs/params.yaml")
    params.optimizer.lr_at(step)      # the learning rate of a step
    params.model.layer_sizes()        # [784, 256, 128, 10]

Any problem becomes one line of text naming the file and the dotted key, e.g.

    params.yaml: optimizer.learning_rate: Input should be a valid number (got 'abc')

To add a section (``csconfig``, precision keys, ...): write a ``_Section``
subclass and add it as a field of ``Params`` with a default factory.
"""
from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    AliasChoices,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "ParamsError",
    "InputConfig",
    "EvalInputConfig",
    "ModelConfig",
    "TransformerModelConfig",
    "LinearSchedule",
    "OptimizerConfig",
    "RunConfig",
    "CSConfig",
    "Params",
    "load_params",
    "params_from_dict",
]


class ParamsError(ValueError):
    """A params file or dict that cannot be used; the message is one line."""


# Strict scalars: pydantic's lax mode would turn "0.05" into 0.05 and 2.0 into
# 2, hiding mistakes in the YAML. A strict float still accepts an int (YAML
# `learning_rate: 1`), which loses nothing. NaN/inf are never a sensible
# hyper-parameter, so they are refused too.
Float = Annotated[float, Field(strict=True), AllowInfNan(False)]
PosInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]


def _lower(value: Any) -> Any:
    """Lower-case strings so `Adam`, `ReLU` etc. match; leave others to fail."""
    return value.lower() if isinstance(value, str) else value


class _Section(BaseModel):
    """Base of every section: unknown keys fail, scalars are typed strictly."""

    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------
# train_input / eval_input


class InputConfig(_Section):
    """One input function's settings (the model-zoo `train_input`)."""

    data_dir: Optional[StrictStr] = None  # None: the embedded data set
    batch_size: PosInt = 128
    shuffle: StrictBool = True
    shuffle_seed: Optional[StrictInt] = None  # None: use runconfig.seed
    drop_last_batch: StrictBool = True
    # Dataloader processes per input worker; informational for now.
    num_workers: NonNegInt = 0
    # Language models (examples/gpt2, examples/bert): tokens per sample
    # (None: the model's max_position_embeddings) and BERT's masking rate.
    max_sequence_length: Optional[PosInt] = None
    masked_lm_prob: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.15

    def seed(self, run_seed: int) -> int:
        """The shuffle seed to use: shuffle_seed, else the run's seed."""
        return run_seed if self.shuffle_seed is None else self.shuffle_seed


class EvalInputConfig(InputConfig):
    """`eval_input`: like train_input, but not shuffled unless asked."""

    shuffle: StrictBool = False


# ---------------------------------------------------------------------------
# model

_DEFAULT_HIDDEN_SIZES = [256, 128]


class ModelConfig(_Section):
    """A fully connected classifier.

    The hidden layers are given either as a list (`hidden_sizes`) or, model-zoo
    style, as `depth` layers of `hidden_size` each; never both.
    """

    hidden_sizes: Optional[Annotated[list[PosInt], Field(min_length=1)]] = None
    depth: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    hidden_size: Optional[PosInt] = None
    activation: Literal["relu", "tanh", "sigmoid", "gelu", "gelu_new", "gelu_tanh"] = "relu"  # gelu: exact
    dropout: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.0
    input_size: PosInt = 784
    num_classes: Annotated[StrictInt, Field(ge=2)] = 10
    # Model-zoo names: 16-bit matmul inputs and streamed tensors, float32 masters.
    mixed_precision: StrictBool = False
    fp16_type: Literal["float16", "bfloat16", "cbfloat16"] = "float16"

    _lower_activation = field_validator("activation", mode="before")(_lower)
    _lower_fp16_type = field_validator("fp16_type", mode="before")(_lower)

    @model_validator(mode="before")
    @classmethod
    def _default_hidden(cls, data: Any) -> Any:
        # Filled in before validation (not after) so that to_dict() of a
        # defaulted model round-trips: it then holds hidden_sizes only.
        if isinstance(data, dict) and all(
            data.get(k) is None for k in ("hidden_sizes", "depth", "hidden_size")
        ):
            data = {**data, "hidden_sizes": list(_DEFAULT_HIDDEN_SIZES)}
        return data

    @model_validator(mode="after")
    def _one_spelling(self) -> "ModelConfig":
        by_depth = self.depth is not None or self.hidden_size is not None
        if self.hidden_sizes is not None and by_depth:
            raise ValueError(
                "give either hidden_sizes or depth and hidden_size, not both"
            )
        if by_depth and (self.depth is None or self.hidden_size is None):
            raise ValueError("depth and hidden_size must be given together")
        return self

    def hidden(self) -> list[int]:
        """The hidden layer widths, whichever spelling was used."""
        if self.hidden_sizes is not None:
            return list(self.hidden_sizes)
        assert self.depth is not None and self.hidden_size is not None
        return [self.hidden_size] * self.depth

    def layer_sizes(self) -> list[int]:
        """[input_size, *hidden, num_classes]: the widths of every layer."""
        return [self.input_size, *self.hidden(), self.num_classes]


class TransformerModelConfig(_Section):
    """A GPT-2 or BERT style language model (model-zoo key names).

    Chosen over the classifier by the `model_type` key.
    """

    model_type: Literal["gpt2", "bert"]
    vocab_size: PosInt = 260                 # the byte-level tokenizer's (cs_runtime/data/text.py)
    hidden_size: PosInt = 64
    num_hidden_layers: PosInt = 2
    num_heads: PosInt = 2
    filter_size: PosInt = 256                # width of each block's MLP
    max_position_embeddings: PosInt = 64
    dropout_rate: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.1
    attention_dropout_rate: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.1
    layer_norm_epsilon: PosFloat = 1e-5

    _lower_type = field_validator("model_type", mode="before")(_lower)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "TransformerModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        return self


def _model_kind(value: Any) -> str:
    if isinstance(value, TransformerModelConfig) or (isinstance(value, dict) and "model_type" in value):
        return "<transformer>"
    return "<classifier>"


AnyModelConfig = Annotated[
    Union[
        Annotated[ModelConfig, Tag("<classifier>")],
        Annotated[TransformerModelConfig, Tag("<transformer>")],
    ],
    Discriminator(_model_kind),
]


# ---------------------------------------------------------------------------
# optimizer


class LinearSchedule(_Section):
    """Model-zoo `learning_rate: {scheduler: Linear, ...}`."""

    scheduler: Literal["linear"]
    initial_learning_rate: NonNegFloat
    end_learning_rate: NonNegFloat
    # Older model-zoo releases call it decay_steps.
    total_iters: PosInt = Field(
        validation_alias=AliasChoices("total_iters", "decay_steps")
    )

    _lower_scheduler = field_validator("scheduler", mode="before")(_lower)

    @model_validator(mode="before")
    @classmethod
    def _not_both_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "total_iters" in data and "decay_steps" in data:
            raise ValueError("give total_iters or decay_steps, not both")
        return data

    def at(self, step: int) -> float:
        """Linear from initial to end over total_iters steps, then held."""
        if step >= self.total_iters:
            return self.end_learning_rate  # exactly, not initial + delta*1.0
        start, end = self.initial_learning_rate, self.end_learning_rate
        return start + (end - start) * (step / self.total_iters)


def _lr_kind(value: Any) -> str:
    # A mapping is a schedule; anything else goes to the number check, whose
    # error ("Input should be a valid number") is the helpful one for 'abc'.
    return "<schedule>" if isinstance(value, (dict, LinearSchedule)) else "<constant>"


# The tags appear in pydantic's error locations; _format_loc drops them.
_UNION_TAGS = frozenset({"<schedule>", "<constant>", "<classifier>", "<transformer>"})

LearningRate = Annotated[
    Union[
        Annotated[PosFloat, Tag("<constant>")],
        Annotated[LinearSchedule, Tag("<schedule>")],
    ],
    Discriminator(_lr_kind),
]

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]

# `loss_scaling_factor: dynamic`, or a fixed positive number (1.0: no scaling).
LossScalingFactor = Union[Literal["dynamic"], PosFloat]


class OptimizerConfig(_Section):
    """The learning rule MemoryX applies (and the CPU oracle mirrors)."""

    optimizer_type: Literal["sgd", "adam", "adamw"] = "sgd"
    learning_rate: LearningRate = 0.01
    momentum: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    max_gradient_norm: Optional[PosFloat] = None  # None: no clipping
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    # Loss scaling for 16-bit gradients (cs_runtime/numerics/precision.py: LossScaler).
    loss_scaling_factor: LossScalingFactor = 1.0
    initial_loss_scale: PosFloat = 2.0 ** 15
    steps_per_increase: PosInt = 2000
    min_loss_scale: PosFloat = 2.0 ** -14
    max_loss_scale: PosFloat = 2.0 ** 24

    _lower_type = field_validator("optimizer_type", mode="before")(_lower)

    @field_validator("loss_scaling_factor", mode="before")
    @classmethod
    def _scaling_factor(cls, value: Any) -> Any:
        # One clear message instead of one per member of the union.
        if isinstance(value, str) and value.lower() == "dynamic":
            return "dynamic"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return float(value)
        raise ValueError("expected 'dynamic' or a positive number")

    @model_validator(mode="after")
    def _scale_bounds(self) -> "OptimizerConfig":
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError("min_loss_scale must not exceed max_loss_scale")
        if self.loss_scaling_factor == "dynamic" and not (
                self.min_loss_scale <= self.initial_loss_scale <= self.max_loss_scale):
            raise ValueError("initial_loss_scale must lie within [min_loss_scale, max_loss_scale]")
        return self

    def optimizer_spec(self) -> dict:
        """The keyword arguments of cs_runtime.numerics.optim.Optimizer (sent to MemoryX as they are)."""
        return {"kind": self.optimizer_type, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "betas": list(self.betas), "eps": self.eps}

    def loss_scaling_mode(self) -> str:
        """none, static or dynamic (LossScaler's modes)."""
        if self.loss_scaling_factor == "dynamic":
            return "dynamic"
        return "none" if self.loss_scaling_factor == 1.0 else "static"

    def lr_at(self, step: int) -> float:
        """The learning rate of `step` (0-based).

        A pure function of `step` and the config, so the CPU oracle and
        MemoryX compute the bit-identical float.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if isinstance(self.learning_rate, LinearSchedule):
            return self.learning_rate.at(step)
        return self.learning_rate


# ---------------------------------------------------------------------------
# runconfig


class RunConfig(_Section):
    """How long to run and what to record."""

    max_steps: PosInt = 100
    log_steps: PosInt = 10
    checkpoint_steps: NonNegInt = 0  # 0: checkpoint only at the end
    seed: StrictInt = 1
    max_checkpoints: Annotated[StrictInt, Field(ge=1)] = 5
    eval_steps: Optional[PosInt] = None  # None: the whole eval set once
    # None: let the compiler choose.
    execution_strategy: Optional[Literal["weight_streaming", "pipelined"]] = None


# ---------------------------------------------------------------------------
# csconfig


class CSConfig(_Section):
    """Settings of the CS system the compiler plans for."""

    # Bytes of on-wafer memory the model may use; None: the WSE-2's 40 GB
    # (cs_runtime/compiler/hardware.py). A small value forces weight streaming.
    wafer_memory_bytes: Optional[PosInt] = None
    # Cerebras's 16-bit format; with model.mixed_precision it replaces fp16_type.
    use_cbfloat16: StrictBool = False


# ---------------------------------------------------------------------------
# the whole file


class Params(_Section):
    """A whole params.yaml; every section is optional."""

    train_input: InputConfig = Field(default_factory=InputConfig)
    eval_input: EvalInputConfig = Field(default_factory=EvalInputConfig)
    model: AnyModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    runconfig: RunConfig = Field(default_factory=RunConfig)
    csconfig: CSConfig = Field(default_factory=CSConfig)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `runconfig:` with every key commented out parses as None; it means
        # "all defaults", as an absent section does.
        if isinstance(data, dict):
            sections = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in sections}
        return data

    @model_validator(mode="after")
    def _one_16bit_format(self) -> "Params":
        if self.csconfig.use_cbfloat16 and "fp16_type" in self.model.model_fields_set \
                and self.model.fp16_type != "cbfloat16":
            raise ValueError(f"csconfig.use_cbfloat16 contradicts model.fp16_type: {self.model.fp16_type}")
        return self

    @property
    def precision(self) -> str:
        """The format of matmul inputs and streamed tensors: float32 unless mixed precision."""
        # Language models (TransformerModelConfig) have no mixed_precision key: float32.
        if not getattr(self.model, "mixed_precision", False):
            return "float32"
        return "cbfloat16" if self.csconfig.use_cbfloat16 else self.model.fp16_type


# ---------------------------------------------------------------------------
# errors as one line


def _format_loc(loc: tuple[Union[int, str], ...]) -> str:
    """('model', 'hidden_sizes', 1) -> 'model.hidden_sizes[1]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_error(err: dict[str, Any]) -> str:
    """One pydantic error as 'dotted.path: what is wrong (got X)'."""
    path = _format_loc(err["loc"]) or "<top level>"
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    # Echo scalars only: for a whole section the value is noise.
    value = err.get("input")
    if err["type"] != "missing" and not isinstance(value, (dict, list, BaseModel)):
        msg += f" (got {_short_repr(value)})"
    return f"{path}: {msg}"


def _one_line(source: str, exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    line = f"{source}: {_format_error(errors[0])}"
    if len(errors) > 1:
        line += f" (+{len(errors) - 1} more)"
    return line.replace("\n", " ")


def params_from_dict(d: Any, source: str = "<params>") -> Params:
    """Validate a dict (e.g. parsed YAML) into Params, or raise ParamsError."""
    if not isinstance(d, dict):
        raise ParamsError(
            f"{source}: top level must be a mapping of sections, "
            f"got {type(d).__name__}"
        )
    try:
        return Params.model_validate(d)
    except ValidationError as exc:
        raise ParamsError(_one_line(source, exc)) from None


# ---------------------------------------------------------------------------
# YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader with two fixes for hand-written params files.

    * `1e-3` is a float (YAML 1.2, and what everyone means); PyYAML follows
      YAML 1.1 and would give the string '1e-3', which then fails the
      number check with a baffling message.
    * A key given twice is an error, not silently the last one.
    """


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
# Replace (not add to) the inherited float resolver, so that it comes before
# the int resolver for strings starting with a digit.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _first in "-+0123456789.":
    _Loader.yaml_implicit_resolvers.setdefault(_first, []).insert(
        0, ("tag:yaml.org,2002:float", _FLOAT_RE)
    )


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {line})", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _yaml_error(source: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{source}: invalid YAML{where}: {problem}".replace("\n", " ")


def load_params(path: Union[str, os.PathLike[str]]) -> Params:
    """Read and validate a params.yaml; any problem is one-line ParamsError.

    An empty file is an empty mapping: every section takes its defaults.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ParamsError(f"{source}: no such file") from None
    except OSError as exc:
        raise ParamsError(f"{source}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ParamsError(_yaml_error(source, exc)) from None
    return params_from_dict({} if data is None else data, source)
