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

import math
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
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from cs_runtime.errors import UserInputError
from cs_runtime.numerics.optim import OptimizerSpec
from cs_runtime.params_compat import (
    CompatError,
    apply_overrides,
    from_trainer,
    is_trainer_layout,
    merge_alias,
    suggest,
)

__all__ = [
    "ParamsError",
    "InputConfig",
    "EvalInputConfig",
    "ModelConfig",
    "TransformerModelConfig",
    "GPT2ModelConfig",
    "BertModelConfig",
    "LinearSchedule",
    "CosineSchedule",
    "ExponentialSchedule",
    "ConstantSchedule",
    "OptimizerConfig",
    "RunConfig",
    "CSConfig",
    "Params",
    "load_params",
    "params_from_dict",
]


class ParamsError(UserInputError):
    """A params file or dict that cannot be used: `lines`, one per problem
    (str() joins them with newlines; most errors are one line)."""

    def __init__(self, lines: Union[str, list[str]]):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


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


def _refuse_unless(allowed: Any, why: str):
    """A field validator: the value must be `allowed` (what the emulator does), else `why`."""
    def check(value: Any) -> Any:
        if value is not None and value != allowed:
            raise ValueError(why)   # the error line adds "(got value)"
        return value
    return check


class InputConfig(_Section):
    """One input function's settings (the model-zoo `train_input`)."""

    # None: the embedded data set. The model zoo also takes a list of folders;
    # one is read here.
    data_dir: Optional[StrictStr] = None
    batch_size: PosInt = 128
    shuffle: StrictBool = True
    shuffle_seed: Optional[StrictInt] = None  # None: use runconfig.seed
    drop_last_batch: StrictBool = True
    # Data-loading threads per input worker (PyTorch DataLoader's num_workers):
    # batches are fetched ahead by this many threads; 0 fetches in the worker's own.
    num_workers: NonNegInt = 0
    # Language models (examples/gpt2, examples/bert): tokens per sample
    # (None: the model's max_position_embeddings) and BERT's masking rate.
    max_sequence_length: Optional[PosInt] = None
    masked_lm_prob: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.15
    # BERT: at most this many masked tokens per sequence (None: no cap).
    max_predictions_per_seq: Optional[PosInt] = None
    # The model zoo's data-processor class; the example's input function reads
    # the data, and this must name a processor of that model (checked by the example).
    data_processor: Optional[StrictStr] = None
    # 16-bit input samples: what mixed precision does to the first layer's input.
    to_float16: Optional[StrictBool] = None
    # Throughput-only DataLoader settings: no effect on which samples a step sees.
    prefetch_factor: Optional[NonNegInt] = None
    persistent_workers: Optional[StrictBool] = None
    num_parallel_calls: Optional[NonNegInt] = None      # FC-MNIST TF's tf.data parallelism
    # BERT's tokenisation of CSV text: here text is byte-tokenised, so these must
    # agree with that (a vocab_file means the data must be pre-tokenised *.npy ids).
    vocab_file: Optional[StrictStr] = None
    do_lower: StrictBool = False
    whole_word_masking: StrictBool = False
    # The model zoo repeats some of these from the model section: they must agree (Params checks).
    vocab_size: Optional[PosInt] = None
    # FC-MNIST (2.5 on): which MNIST split the section reads (val is the test split).
    split: Optional[Literal["train", "val", "test"]] = None
    # Training data repeats for as many steps as the run takes; an eval pass is one pass.
    repeat: Optional[StrictBool] = None
    # BERT (1.x): scale the masked-LM loss by batch_size / masked tokens, per batch: the mean over
    # the masked tokens (mlm_loss_scaling num_masked, lm_checks.mlm_loss_scaling).
    dynamic_mlm_scale: Optional[StrictBool] = None

    @field_validator("data_dir", mode="before")
    @classmethod
    def _one_folder(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(f"a list of {len(value)} data folders; give one folder here")
            return value[0]
        return value

    _whole_words = field_validator("whole_word_masking")(
        _refuse_unless(False, "whole-word masking needs a word-piece tokenizer; tokens are masked one by one"))

    def seed(self, run_seed: int) -> int:
        """The shuffle seed to use: shuffle_seed, else the run's seed."""
        return run_seed if self.shuffle_seed is None else self.shuffle_seed


class EvalInputConfig(InputConfig):
    """`eval_input`: like train_input, but not shuffled unless asked."""

    shuffle: StrictBool = False


# ---------------------------------------------------------------------------
# model

_DEFAULT_HIDDEN_SIZES = [256, 128]
Fp16Type = Literal["float16", "bfloat16", "cbfloat16"]


class _ModelBase(_Section):
    """Keys every model-zoo model section has."""

    name: Optional[StrictStr] = None      # the model zoo's model name; must be the script's model
    mixed_precision: StrictBool = False   # 16-bit matmul inputs and streamed tensors, float32 masters
    fp16_type: Fp16Type = "float16"
    use_bfloat16: Optional[StrictBool] = None   # 1.x spelling of fp16_type: bfloat16
    to_float16: Optional[StrictBool] = None     # 1.x: the model in 16 bits (with mixed_precision: the same)
    # Cluster tuning of the real system: no effect on the numbers.
    precision_opt_level: Optional[StrictInt] = None

    _lower_fp16_type = field_validator("fp16_type", mode="before")(_lower)

    @model_validator(mode="after")
    def _sixteen_bits(self) -> "_ModelBase":
        if self.use_bfloat16:
            if "fp16_type" in self.model_fields_set and self.fp16_type != "bfloat16":
                raise ValueError(f"use_bfloat16: true contradicts fp16_type: {self.fp16_type}")
            self.fp16_type = "bfloat16"
        if self.to_float16 and not self.mixed_precision:
            raise ValueError("to_float16: true without mixed_precision (float16 master weights) is not "
                             "emulated; set mixed_precision: true")
        return self


class ModelConfig(_ModelBase):
    """A fully connected classifier (FC-MNIST).

    The hidden layers are given either as a list (`hidden_sizes`) or, model-zoo
    style, as `depth` layers of `hidden_size` each; never both.
    """

    hidden_sizes: Optional[Annotated[list[PosInt], Field(min_length=1)]] = None
    depth: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    hidden_size: Optional[PosInt] = None
    activation_fn: Literal["relu", "tanh", "sigmoid", "gelu", "gelu_new", "gelu_tanh"] = "relu"  # gelu: exact (erf)
    dropout: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.0
    input_size: PosInt = 784
    num_classes: Annotated[StrictInt, Field(ge=2)] = 10
    # Eval always reports the loss and the accuracy.
    compute_eval_metrics: Optional[Union[StrictBool, list[StrictStr]]] = None

    _lower_activation = field_validator("activation_fn", mode="before")(_lower)

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

    @property
    def activation(self) -> str:
        return self.activation_fn

    def hidden(self) -> list[int]:
        """The hidden layer widths, whichever spelling was used."""
        if self.hidden_sizes is not None:
            return list(self.hidden_sizes)
        assert self.depth is not None and self.hidden_size is not None
        return [self.hidden_size] * self.depth

    def layer_sizes(self) -> list[int]:
        """[input_size, *hidden, num_classes]: the widths of every layer."""
        return [self.input_size, *self.hidden(), self.num_classes]


class TransformerModelConfig(_ModelBase):
    """A GPT-2 or BERT style language model (model-zoo key names).

    Which one comes from the example script (examples/gpt2, examples/bert); the
    older `model_type` key is still read where no script says.
    """

    model_type: Optional[Literal["gpt2", "bert"]] = None
    vocab_size: PosInt = 260                 # the byte-level tokenizer's (cs_runtime/data/text.py)
    hidden_size: PosInt = 64
    num_hidden_layers: PosInt = 2
    num_heads: PosInt = 2
    filter_size: PosInt = 256                # width of each block's MLP
    max_position_embeddings: PosInt = 64
    dropout_rate: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.1
    attention_dropout_rate: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.1
    layer_norm_epsilon: PosFloat = 1e-5
    # Model-zoo keys whose only emulated value is the one the model zoo ships.
    position_embedding_type: Optional[StrictStr] = "learned"
    embedding_dropout_rate: Optional[Annotated[Float, Field(ge=0.0, lt=1.0)]] = None  # None: dropout_rate
    attention_type: Optional[StrictStr] = "scaled_dot_product"
    attention_softmax_fp32: Optional[StrictBool] = True
    use_projection_bias_in_attention: Optional[StrictBool] = True
    use_ffn_bias_in_attention: Optional[StrictBool] = True
    use_ffn_bias: Optional[StrictBool] = True
    initializer_range: Optional[PosFloat] = 0.02
    # Tied token embedding and output head, and GPT-2's output bias: None means the
    # model zoo's default (tied; GPT-2 without an output bias): lm_checks.head_options.
    share_embedding_weights: Optional[StrictBool] = None
    use_bias_in_output: Optional[StrictBool] = None

    _lower_type = field_validator("model_type", mode="before")(_lower)
    _positions = field_validator("position_embedding_type")(
        _refuse_unless("learned", "only learned position embeddings are emulated"))
    _attention = field_validator("attention_type")(
        _refuse_unless("scaled_dot_product", "only scaled_dot_product attention is emulated"))
    _softmax = field_validator("attention_softmax_fp32")(
        _refuse_unless(True, "the attention softmax is always computed in float32 here"))
    _qkv_bias = field_validator("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias")(
        _refuse_unless(True, "bias-free attention and MLP layers are not emulated"))
    _init = field_validator("initializer_range")(
        _refuse_unless(0.02, "weights are initialised with N(0, 0.02) here"))

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "TransformerModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.embedding_dropout_rate is not None and self.embedding_dropout_rate != self.dropout_rate:
            raise ValueError(f"embedding_dropout_rate {self.embedding_dropout_rate} differs from dropout_rate "
                             f"{self.dropout_rate}; one dropout rate for embeddings and blocks is emulated")
        return self


class GPT2ModelConfig(TransformerModelConfig):
    """examples/gpt2: the model zoo's GPT-2 model section."""

    nonlinearity: Literal["gelu"] = "gelu"
    # The model zoo's GPT-2 loss: the mean over predicted tokens (num_tokens), or their sum
    # * loss_weight / batch_size (batch_size; a loss_weight other than 1 makes it batch_size,
    # as the model zoo falls back): lm_checks.gpt2_loss.
    loss_scaling: Literal["num_tokens", "batch_size"] = "num_tokens"
    loss_weight: PosFloat = 1.0
    # 1.x: learned position embeddings (the only kind emulated; false would leave them out).
    use_position_embedding: Optional[StrictBool] = None

    _lower_nl = field_validator("nonlinearity", "loss_scaling", mode="before")(_lower)
    _positions_on = field_validator("use_position_embedding")(
        _refuse_unless(True, "a GPT-2 without position embeddings is not emulated"))


class BertModelConfig(TransformerModelConfig):
    """examples/bert: the model zoo's BERT (pre-training) model section."""

    encoder_nonlinearity: Literal["gelu"] = "gelu"
    # The next-sentence head (the model zoo's default; disable_nsp: true leaves it out):
    # segment embeddings (num_segments of them, the model zoo's key, default 2), a pooler
    # (dense + pooler_nonlinearity, default tanh, on the first token) and a 2-way classifier.
    pooler_nonlinearity: Optional[Literal["tanh", "relu", "sigmoid", "gelu", "gelu_new"]] = None
    disable_nsp: Optional[StrictBool] = None
    num_segments: Optional[PosInt] = None
    # The masked-LM loss is the model zoo's sum over predicted tokens * mlm_loss_weight
    # / batch_size (transformer_spec's default for BERT, with the weight 1.0 when None),
    mlm_loss_weight: Optional[PosFloat] = None
    # or the mean over the masked tokens (num_masked; precomputed_num_masked is the same number).
    mlm_loss_scaling: Literal["batch_size", "num_masked", "precomputed_num_masked"] = "batch_size"
    # The masked-LM decoder's bias (the model zoo's default: true), tied or not.
    use_output_bias_in_mlm: Optional[StrictBool] = None

    _lower_nl = field_validator("encoder_nonlinearity", "mlm_loss_scaling", "pooler_nonlinearity",
                                mode="before")(_lower)


MODEL_CONFIGS: dict[str, type[_ModelBase]] = {"fc_mnist": ModelConfig, "gpt2": GPT2ModelConfig,
                                              "bert": BertModelConfig}


def _model_kind(value: Any) -> str:
    """Without a script to say (params_from_dict(model=None)): model_type, else name, else a classifier."""
    if isinstance(value, _ModelBase):
        return next((k for k, c in MODEL_CONFIGS.items() if type(value) is c), "fc_mnist")
    if isinstance(value, dict):
        for key in ("model_type", "name"):
            if isinstance(value.get(key), str) and value[key].lower() in MODEL_CONFIGS:
                return value[key].lower()
        # A section written by to_dict() of a language model names its nonlinearity key.
        if "encoder_nonlinearity" in value:
            return "bert"
        if "nonlinearity" in value:
            return "gpt2"
    return "fc_mnist"


AnyModelConfig = Annotated[
    Union[
        Annotated[ModelConfig, Tag("fc_mnist")],
        Annotated[GPT2ModelConfig, Tag("gpt2")],
        Annotated[BertModelConfig, Tag("bert")],
    ],
    Discriminator(_model_kind),
]


# ---------------------------------------------------------------------------
# optimizer: learning-rate schedules (model-zoo `learning_rate: {scheduler: ...}`)


class _Schedule(_Section):
    """One piece of a schedule; `steps` (also total_iters, decay_steps) is its length."""

    scheduler: StrictStr
    steps: Optional[PosInt] = Field(default=None, validation_alias=AliasChoices("steps", "total_iters", "decay_steps"))

    @model_validator(mode="before")
    @classmethod
    def _one_length_name(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in ("steps", "total_iters", "decay_steps") if k in data]
            if len(given) > 1:
                raise ValueError(f"give one of {' / '.join(given)}, not both")
        return data

    @property
    def total_iters(self) -> Optional[int]:
        return self.steps


class LinearSchedule(_Schedule):
    """Linear from initial to end over `steps`, then held at end."""

    scheduler: Literal["linear"]
    initial_learning_rate: NonNegFloat
    end_learning_rate: NonNegFloat
    cycle: Literal[False] = False

    _lower_scheduler = field_validator("scheduler", mode="before")(_lower)

    def at(self, step: int) -> float:
        if self.steps is None or step >= self.steps:
            return self.end_learning_rate  # exactly, not initial + delta*1.0
        start, end = self.initial_learning_rate, self.end_learning_rate
        return start + (end - start) * (step / self.steps)


class CosineSchedule(_Schedule):
    """Cosine from initial to end over `steps` (model zoo CosineDecay), then held at end."""

    scheduler: Literal["cosinedecay", "cosine"]
    initial_learning_rate: NonNegFloat
    end_learning_rate: NonNegFloat

    @field_validator("scheduler", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        return value.lower().replace("_", "") if isinstance(value, str) else value

    def at(self, step: int) -> float:
        if self.steps is None or step >= self.steps:
            return self.end_learning_rate
        start, end = self.initial_learning_rate, self.end_learning_rate
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * step / self.steps))


class ExponentialSchedule(_Schedule):
    """initial * decay_rate ** (step / decay_steps) (floored with staircase)."""

    scheduler: Literal["exponential"]
    initial_learning_rate: NonNegFloat
    decay_rate: PosFloat
    staircase: StrictBool = False

    _lower_scheduler = field_validator("scheduler", mode="before")(_lower)

    @model_validator(mode="after")
    def _needs_steps(self) -> "ExponentialSchedule":
        if self.steps is None:
            raise ValueError("Exponential needs decay_steps (or steps)")
        return self

    def at(self, step: int) -> float:
        power = step / self.steps
        return self.initial_learning_rate * self.decay_rate ** (math.floor(power) if self.staircase else power)


class ConstantSchedule(_Schedule):
    """`learning_rate` for `steps` (or for ever)."""

    scheduler: Literal["constant"]
    learning_rate: NonNegFloat

    _lower_scheduler = field_validator("scheduler", mode="before")(_lower)

    def at(self, step: int) -> float:
        return self.learning_rate


SCHEDULES = {"linear": LinearSchedule, "cosinedecay": CosineSchedule, "cosine": CosineSchedule,
             "exponential": ExponentialSchedule, "constant": ConstantSchedule}


def _schedule_kind(value: Any) -> str:
    if isinstance(value, _Schedule):
        return type(value).__name__
    name = value.get("scheduler") if isinstance(value, dict) else None
    cls = SCHEDULES.get(name.lower().replace("_", "")) if isinstance(name, str) else None
    return cls.__name__ if cls else "LinearSchedule"   # whose Literal names the supported ones


AnySchedule = Annotated[
    Union[tuple(Annotated[c, Tag(c.__name__)] for c in dict.fromkeys(SCHEDULES.values()))],
    Discriminator(_schedule_kind),
]


def _lr_kind(value: Any) -> str:
    # A mapping is a schedule, a list a sequence of them; anything else goes to the
    # number check, whose error ("Input should be a valid number") is the helpful one for 'abc'.
    if isinstance(value, (list, tuple)):
        return "<sequence>"
    return "<schedule>" if isinstance(value, (dict, _Schedule)) else "<constant>"


# The tags appear in pydantic's error locations; _format_loc drops them.
_UNION_TAGS = frozenset({"<schedule>", "<constant>", "<sequence>", *MODEL_CONFIGS,
                         *(c.__name__ for c in SCHEDULES.values())})

LearningRate = Annotated[
    Union[
        Annotated[PosFloat, Tag("<constant>")],
        Annotated[AnySchedule, Tag("<schedule>")],
        Annotated[Annotated[list[AnySchedule], Field(min_length=1)], Tag("<sequence>")],
    ],
    Discriminator(_lr_kind),
]

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]

# `loss_scaling_factor: dynamic`, or a fixed positive number (1.0: no scaling).
LossScalingFactor = Union[Literal["dynamic"], PosFloat]


class OptimizerConfig(_Section):
    """The learning rule MemoryX applies (and the CPU oracle mirrors).

    Defaults are the model zoo's: eps 1e-6, betas (0.9, 0.999), no weight decay
    of biases and normalisation weights.
    """

    optimizer_type: Literal["sgd", "adam", "adamw"] = "sgd"
    learning_rate: LearningRate = 0.01
    momentum: NonNegFloat = 0.0
    nesterov: StrictBool = False               # SGD: Nesterov momentum (torch.optim.SGD's rule)
    dampening: NonNegFloat = 0.0               # SGD: the gradient's share (1 - dampening) in the momentum
    weight_decay: NonNegFloat = 0.0            # also weight_decay_rate (1.x)
    # The model zoo never decays biases and normalisation (LayerNorm) weights.
    exclude_bias_and_norm: StrictBool = True
    max_gradient_norm: Optional[PosFloat] = None  # None: no clipping
    max_gradient_value: Optional[NonNegFloat] = None
    betas: tuple[Beta, Beta] = OptimizerSpec.betas   # also beta1 / beta2
    eps: PosFloat = OptimizerSpec.eps           # also epsilon
    correct_bias: Literal[True] = True          # Adam's bias correction (always applied)
    use_bias_correction: Literal[True] = True   # 1.x spelling of correct_bias
    # Loss scaling for 16-bit gradients (cs_runtime/numerics/precision.py: LossScaler).
    loss_scaling_factor: LossScalingFactor = 1.0
    initial_loss_scale: PosFloat = 2.0 ** 15
    steps_per_increase: PosInt = 2000
    min_loss_scale: PosFloat = 2.0 ** -14
    max_loss_scale: PosFloat = 2.0 ** 24
    log_summaries: StrictBool = False           # the loss scale is logged whenever it can change
    # Schedules restart their step count at each piece (the model zoo's default); true: each
    # piece is computed at the global step (the model zoo's 1.x BERT files), see lr_at.
    disable_lr_steps_reset: StrictBool = False
    grad_accum_steps: Annotated[StrictInt, Field(ge=1, le=1)] = 1

    _lower_type = field_validator("optimizer_type", mode="before")(_lower)

    @model_validator(mode="before")
    @classmethod
    def _model_zoo_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = merge_alias(data, "weight_decay", "weight_decay_rate")
        data = merge_alias(data, "eps", "epsilon")
        if "beta1" in data or "beta2" in data:
            betas = (data.pop("beta1", 0.9), data.pop("beta2", 0.999))
            if "betas" in data and tuple(data["betas"]) != betas:
                raise ValueError(f"beta1/beta2 {list(betas)} contradict betas {data['betas']}")
            data["betas"] = list(betas)
        if data.get("correct_bias") is False or data.get("use_bias_correction") is False:
            raise ValueError("correct_bias: false (Adam without bias correction) is not emulated")
        return data

    @field_validator("loss_scaling_factor", mode="before")
    @classmethod
    def _scaling_factor(cls, value: Any) -> Any:
        # One clear message instead of one per member of the union.
        if isinstance(value, str) and value.lower() == "dynamic":
            return "dynamic"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return float(value)
        raise ValueError("expected 'dynamic' or a positive number")

    @field_validator("grad_accum_steps", mode="before")
    @classmethod
    def _accumulation(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ValueError("gradient accumulation is not emulated: one step is one batch; raise batch_size")
        return value

    @model_validator(mode="after")
    def _scale_bounds(self) -> "OptimizerConfig":
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError("min_loss_scale must not exceed max_loss_scale")
        if self.loss_scaling_factor == "dynamic" and not (
                self.min_loss_scale <= self.initial_loss_scale <= self.max_loss_scale):
            raise ValueError("initial_loss_scale must lie within [min_loss_scale, max_loss_scale]")
        if self.max_gradient_value and self.max_gradient_norm:
            raise ValueError("give max_gradient_norm or max_gradient_value, not both (the model zoo clips "
                             "one way)")
        if self.max_gradient_value:
            raise ValueError("max_gradient_value (clipping each gradient element) is not emulated; use "
                             "max_gradient_norm")
        self.optimizer_spec()   # the learning rule's own checks (OptimizerSpec), written once
        schedule = self.learning_rate
        if isinstance(schedule, list) and any(piece.steps is None for piece in schedule[:-1]):
            raise ValueError("learning_rate: every schedule but the last needs steps (or total_iters)")
        return self

    def optimizer_spec(self) -> OptimizerSpec:
        """The learning rule MemoryX, the WSEs and the CPU path apply (ValueError where it is inconsistent)."""
        return OptimizerSpec(self.optimizer_type, momentum=self.momentum, weight_decay=self.weight_decay,
                             betas=self.betas, eps=self.eps, exclude_bias_and_norm=self.exclude_bias_and_norm,
                             nesterov=self.nesterov, dampening=self.dampening)

    def loss_scaling_mode(self) -> str:
        """none, static or dynamic (LossScaler's modes)."""
        if self.loss_scaling_factor == "dynamic":
            return "dynamic"
        return "none" if self.loss_scaling_factor == 1.0 else "static"

    def lr_at(self, step: int) -> float:
        """The learning rate of `step` (0-based).

        A pure function of `step` and the config, so the CPU oracle and
        MemoryX compute the bit-identical float. A list of schedules runs
        each for its `steps`, the next one counting from 0 again (with
        disable_lr_steps_reset: from the global step); the last one holds on.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        schedule = self.learning_rate
        if isinstance(schedule, float):
            return schedule
        pieces = schedule if isinstance(schedule, list) else [schedule]
        start = 0   # the global step the piece begins at
        for piece in pieces[:-1]:
            if step < start + piece.steps:
                break
            start += piece.steps
        else:
            piece = pieces[-1]
        return piece.at(step if self.disable_lr_steps_reset else step - start)


# ---------------------------------------------------------------------------
# runconfig


class RunConfig(_Section):
    """How long to run and what to record.

    The length of a training run is one of max_steps (the global step to stop
    at), num_steps (steps to run from where the run starts), or num_epochs
    (passes over the training data, of steps_per_epoch steps each, by default
    all the full batches the data holds). None of them: 100 steps. max_steps
    with num_steps or num_epochs: the run stops at the first it reaches (the
    real cstorch.utils.data.compute_num_steps takes the smallest).
    """

    max_steps: Optional[PosInt] = None
    num_steps: Optional[PosInt] = None
    num_epochs: Optional[PosInt] = None
    steps_per_epoch: Optional[PosInt] = None
    log_steps: PosInt = 10                 # also save_summary_steps (TF)
    checkpoint_steps: NonNegInt = 0        # 0: checkpoint only at the end; also save_checkpoints_steps (TF)
    save_initial_checkpoint: StrictBool = False
    seed: StrictInt = 1
    max_checkpoints: Annotated[StrictInt, Field(ge=1)] = 5   # also keep_checkpoint_max
    eval_steps: Optional[PosInt] = None  # None: the whole eval set once
    # train_and_eval: evaluate every eval_frequency steps (and at the end).
    eval_frequency: Optional[PosInt] = None
    # None: let the compiler choose.
    execution_strategy: Optional[Literal["weight_streaming", "pipelined"]] = None
    # run.py's command line sets these here (--model_dir, --mode, ...): in a
    # file they must agree with it or are the defaults; see runner.py.
    model_dir: Optional[StrictStr] = None
    mode: Optional[Literal["train", "eval", "train_and_eval", "eval_all"]] = None
    # run.py's --validate_only / --compile_only, as the model zoo also reads them from here.
    validate_only: Optional[StrictBool] = None
    compile_only: Optional[StrictBool] = None
    # How the job reaches and uses the real cluster (csrun_wse's flags here);
    # they cannot change a number. Listed so files that carry them run.
    cs_ip: Optional[StrictStr] = None
    multireplica: Optional[StrictBool] = None
    num_wgt_servers: Optional[StrictInt] = None
    num_act_servers: Optional[StrictInt] = None
    num_csx: Optional[StrictInt] = None
    num_workers_per_csx: Optional[StrictInt] = None
    mount_dirs: Optional[list[StrictStr]] = None
    python_paths: Optional[list[StrictStr]] = None
    job_labels: Optional[list[StrictStr]] = None
    compile_dir: Optional[StrictStr] = None
    job_time_sec: Optional[StrictInt] = None
    use_cs_grad_accum: Optional[StrictBool] = None   # the CS may split a batch; the sum is the same
    use_appliance_data: Optional[StrictBool] = None
    # What gets logged: the loss is always logged every log_steps.
    save_losses: Optional[StrictBool] = None
    show_debug_metrics: Optional[StrictBool] = None
    enable_summaries: Optional[StrictBool] = None
    log_step_count_steps: Optional[PosInt] = None
    autoload_last_checkpoint: StrictBool = True
    disable_version_check: Optional[StrictBool] = None

    @model_validator(mode="before")
    @classmethod
    def _model_zoo_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = merge_alias(data, "checkpoint_steps", "save_checkpoints_steps")
        data = merge_alias(data, "max_checkpoints", "keep_checkpoint_max")
        return merge_alias(data, "log_steps", "save_summary_steps")

    @model_validator(mode="after")
    def _one_length(self) -> "RunConfig":
        if self.num_steps is not None and self.num_epochs is not None:
            raise ValueError("give num_steps or num_epochs, not both (max_steps may go with either)")
        if self.steps_per_epoch is not None and self.num_epochs is None:
            raise ValueError("steps_per_epoch is for num_epochs")
        if not self.autoload_last_checkpoint:
            raise ValueError("autoload_last_checkpoint: false is not emulated: a run resumes from the latest "
                             "checkpoint in model_dir")
        return self

    def stop_step(self, start: int, batches_per_epoch: Optional[int] = None) -> int:
        """The global step training stops at, for a run that starts at `start`."""
        stops = []
        if self.max_steps is not None:
            stops.append(self.max_steps)
        if self.num_steps is not None:
            stops.append(start + self.num_steps)
        if self.num_epochs is not None:
            per_epoch = self.steps_per_epoch or batches_per_epoch
            if not per_epoch:
                raise UserInputError("runconfig.num_epochs: the training data holds no full batch")
            stops.append(self.num_epochs * per_epoch)
        return min(stops) if stops else 100


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

    _not_modelled: list[str] = PrivateAttr(default_factory=list)

    train_input: InputConfig = Field(default_factory=InputConfig)
    eval_input: EvalInputConfig = Field(default_factory=EvalInputConfig)
    model: AnyModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    runconfig: RunConfig = Field(default_factory=RunConfig)
    csconfig: CSConfig = Field(default_factory=CSConfig)
    description: Optional[StrictStr] = None   # FC-MNIST TF's free-text line

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
        for name in ("train_input", "eval_input"):
            if getattr(self, name).to_float16 and not self.model.mixed_precision:
                raise ValueError(f"{name}.to_float16: true needs model.mixed_precision: true (16-bit "
                                 "inputs to a float32 model are not emulated)")
        return self

    @model_validator(mode="after")
    def _repeated_keys_agree(self) -> "Params":
        vocab = getattr(self.model, "vocab_size", None)
        for name in ("train_input", "eval_input"):
            given = getattr(self, name).vocab_size
            if given is not None and given != vocab:
                raise ValueError(f"{name}.vocab_size {given} differs from model.vocab_size {vocab}")
        if self.train_input.repeat is False:
            raise ValueError("train_input.repeat: false is not emulated: training data repeats for as many "
                             "steps as the run takes")
        return self

    def __eq__(self, other: object) -> bool:
        # The settings, not which keys of the file were named as not modelled (a to_dict() round trip
        # of a 2.x file names them by their 1.x path).
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = None   # mutable, as every pydantic model

    @property
    def not_modelled(self) -> list[str]:
        """The model-zoo keys of the file accepted but not modelled, each 'key (why)' (NOT_MODELLED)."""
        return list(self._not_modelled)

    @property
    def precision(self) -> str:
        """The format of matmul inputs and streamed tensors: float32 unless mixed precision."""
        if not self.model.mixed_precision:
            return "float32"
        return "cbfloat16" if self.csconfig.use_cbfloat16 else self.model.fp16_type


class _FcMnistParams(Params):
    model: ModelConfig = Field(default_factory=ModelConfig)

    @model_validator(mode="before")
    @classmethod
    def _adam_by_default(cls, data: Any) -> Any:
        # The model zoo's FC-MNIST: TF trains with Adam when optimizer_type is not
        # given (PyTorch files always give it).
        if isinstance(data, dict) and isinstance(data.get("optimizer"), dict) \
                and "optimizer_type" not in data["optimizer"]:
            data = {**data, "optimizer": {"optimizer_type": "adam", **data["optimizer"]}}
        # The TF model (no eval_input) evaluates on the test split of train_input's
        # data_dir, in train_input's batches, the last partial one dropped.
        train = data.get("train_input") if isinstance(data, dict) else None
        if isinstance(train, dict) and "eval_input" not in data:
            data = {**data, "eval_input": {"data_dir": train.get("data_dir"), "drop_last_batch": True,
                                           **({"batch_size": train["batch_size"]} if "batch_size" in train else {})}}
        return data


class _Gpt2Params(Params):
    model: GPT2ModelConfig = Field(default_factory=GPT2ModelConfig)


class _BertParams(Params):
    model: BertModelConfig = Field(default_factory=BertModelConfig)


PARAMS_OF_MODEL: dict[Optional[str], type[Params]] = {None: Params, "fc_mnist": _FcMnistParams,
                                                      "gpt2": _Gpt2Params, "bert": _BertParams}


# ---------------------------------------------------------------------------
# keys accepted and named as not modelled

# Model-zoo keys of shipped params files that the emulator accepts and names, once, as not
# modelled (params.not_modelled; run.py prints them in one line): each either changes only how
# fast the real system runs, or is a setting whose effect is not emulated, said here.
_SAME_NUMBERS = "changes the real system's speed, not the numbers"
_INIT = "weights start from N(0, 0.02) here (the model zoo's default initializer), whatever this says"
_MUP = "muP is not emulated: learning rates, logits and embeddings are not rescaled, so the numbers differ"
NOT_MODELLED: dict[str, dict[str, str]] = {
    "model": {
        "enable_vts": f"variable tensor shapes {_SAME_NUMBERS}",
        "attention_kernel": f"the attention kernel's choice {_SAME_NUMBERS}",
        "allow_multireplica": "a permission of the real compiler; run.py's --multireplica asks for it here",
        "embedding_initializer": _INIT, "initializer": _INIT, "output_layer_initializer": _INIT,
        "mask_padding_in_positional_embed": "padding tokens keep their position embeddings (they are left "
                                            "out of attention and the loss)",
        **{key: _MUP for key in ("mup_base_hidden_size", "mup_base_filter_size", "embeddings_scale",
                                 "output_logits_alpha", "attention_logits_alpha", "scale_qk_dot_by_d")},
    },
    "train_input": {"buckets": f"VTS length buckets {_SAME_NUMBERS}"},
    "eval_input": {"buckets": f"VTS length buckets {_SAME_NUMBERS}"},
}
# In a learning-rate piece: keys of other schedules the model zoo leaves unused in this one.
_UNUSED_IN_PIECE = {"alpha": "not a parameter of this schedule (the model zoo's Linear leaves it unused)"}


def _take_not_modelled(d: dict, origins: dict[str, str]) -> tuple[dict, list[str]]:
    """d without the NOT_MODELLED keys (a shallow copy where any went), and 'key (why)' for each."""
    d, named = dict(d), []
    for section, keys in NOT_MODELLED.items():
        part = d.get(section)
        if not isinstance(part, dict) or not set(part) & set(keys):
            continue
        d[section] = {k: v for k, v in part.items() if k not in keys}
        named += [f"{_with_origin(f'{section}.{k}', origins)} ({keys[k]})" for k in part if k in keys]
    lr = d.get("optimizer", {}).get("learning_rate") if isinstance(d.get("optimizer"), dict) else None
    if isinstance(lr, list) and any(isinstance(p, dict) and set(p) & set(_UNUSED_IN_PIECE) for p in lr):
        pieces = []
        for i, piece in enumerate(lr):
            if isinstance(piece, dict):
                for key in set(piece) & set(_UNUSED_IN_PIECE):
                    named.append(f"optimizer.learning_rate[{i}].{key} ({_UNUSED_IN_PIECE[key]})")
                piece = {k: v for k, v in piece.items() if k not in _UNUSED_IN_PIECE}
            pieces.append(piece)
        d["optimizer"] = {**d["optimizer"], "learning_rate": pieces}
    return d, named


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
    if path == "<top level>" and err["type"] == "value_error":
        return err["msg"].removeprefix("Value error, ")   # a check across sections names its keys itself
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


def _fields_of(section: Any) -> list[str]:
    """A section class's keys, with their other accepted names."""
    return [a for name, f in section.model_fields.items()
            for a in ([name] + list(getattr(f.validation_alias, "choices", []) or []))]


def _known_keys(model_cls: type[Params], raw_loc: tuple) -> list[str]:
    """The keys allowed where an unknown key was found (for a suggestion)."""
    loc = tuple(p for p in raw_loc if p not in _UNION_TAGS)
    if len(loc) <= 1:
        return list(model_cls.model_fields)
    if len(loc) != 2:
        return []
    if loc[0] == "model" and len(raw_loc) > 2 and raw_loc[1] in MODEL_CONFIGS:   # chosen by model_type / name
        return _fields_of(MODEL_CONFIGS[raw_loc[1]])
    field = model_cls.model_fields.get(str(loc[0]))
    section = field.annotation if field is not None else None
    if isinstance(section, type) and issubclass(section, BaseModel):
        return _fields_of(section)
    return []


def _error_lines(source: str, exc: ValidationError, model_cls: type[Params],
                 origins: dict[str, str]) -> list[str]:
    """Every pydantic error as its own line, each said once, naming the key the user wrote."""
    lines = []
    for err in exc.errors(include_url=False):
        line = _format_error(err)
        if err["type"] == "extra_forbidden":
            loc = tuple(p for p in err["loc"] if p not in _UNION_TAGS)
            section = str(loc[0]) if len(loc) == 2 else None
            hint = suggest(section, str(loc[-1]), _known_keys(model_cls, tuple(err["loc"])))
            if hint:
                line += f": did you mean {hint}?"
        line = _with_origin(line, origins)
        text = f"{source}: {line}".replace("\n", " ")
        if text not in lines:
            lines.append(text)
    return lines


def _with_origin(line: str, origins: dict[str, str]) -> str:
    """'runconfig.max_steps: ...' -> 'trainer.init.loop.max_steps: ...' for a 2.x file."""
    path, sep, rest = line.partition(": ")
    if path in origins:
        return f"{origins[path]}{sep}{rest}"
    section, dot, tail = path.partition(".")
    if section in origins:
        return f"{origins[section]}{dot}{tail}{sep}{rest}"
    return line


def _check_model_name(d: dict, model: Optional[str]) -> list[str]:
    """The model section's name/model_type must be the script's model."""
    section = d.get("model")
    if model is None or not isinstance(section, dict):
        return []
    errors = []
    for key in ("name", "model_type"):
        named = section.get(key)
        if isinstance(named, str) and named.lower() != model:
            errors.append(f"model.{key}: {named!r}, but this script builds {model}")
    return errors


def params_from_dict(d: Any, source: str = "<params>", model: Optional[str] = None) -> Params:
    """Validate a dict (e.g. parsed YAML) into Params, or raise ParamsError with
    every problem, one line each.

    `model` is the model the calling script builds (fc_mnist, gpt2, bert), which
    says what the `model` section may hold; None: `model.model_type` / `model.name`
    say, else a classifier. A 2.x file (`trainer:`) is read as the sections it maps to.
    """
    if not isinstance(d, dict):
        raise ParamsError(
            f"{source}: top level must be a mapping of sections, "
            f"got {type(d).__name__}"
        )
    if model not in PARAMS_OF_MODEL:
        raise ValueError(f"unknown model {model!r}; expected one of {sorted(k for k in PARAMS_OF_MODEL if k)}")
    origins: dict[str, str] = {}
    if is_trainer_layout(d):
        try:
            d, origins = from_trainer(d)
        except CompatError as exc:
            raise ParamsError(f"{source}: {exc}") from None
    model_cls = PARAMS_OF_MODEL[model]
    early = [f"{source}: {_with_origin(e, origins)}" for e in _check_model_name(d, model)]
    d, not_modelled = _take_not_modelled(d, origins)
    try:
        params = model_cls.model_validate(d)
    except ValidationError as exc:
        raise ParamsError(early + _error_lines(source, exc, model_cls, origins)) from None
    if early:
        raise ParamsError(early)
    params._not_modelled = not_modelled
    return params


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
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        value = loader.construct_object(value_node, deep=True)
        # The same value twice says one thing (a shipped model zoo file has `steps: 150000` twice).
        if key in seen and seen[key] != value:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} with another value (line {line})", key_node.start_mark
            )
        seen[key] = value
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _yaml_error(source: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{source}: invalid YAML{where}: {problem}".replace("\n", " ")


def read_params_file(path: Union[str, os.PathLike[str]]) -> Any:
    """The parsed YAML of a params file; a missing, unreadable, invalid or empty file is a ParamsError."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ParamsError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ParamsError(f"{source}: is a folder, not a params file") from None
    except OSError as exc:
        raise ParamsError(f"{source}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ParamsError(_yaml_error(source, exc)) from None
    if data is None or data == {}:
        raise ParamsError(f"{source}: the params file is empty (a model-zoo params file has train_input, "
                          "model, optimizer and runconfig sections)")
    return data


def parse_value(text: str) -> Any:
    """A value as a params file would read it (1e-3 a float, true a bool, [1, 2] a list)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def load_params(path: Union[str, os.PathLike[str]], model: Optional[str] = None,
                overrides: Optional[list[str]] = None) -> Params:
    """Read and validate a params.yaml; any problem is a ParamsError (a line per problem).

    `model`: see params_from_dict. `overrides`: ["runconfig.max_steps=10", ...],
    dotted paths into the file as written, set before validation.
    """
    source = os.fspath(path)
    data = read_params_file(source)
    if overrides:
        if not isinstance(data, dict):
            raise ParamsError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
        try:
            data = apply_overrides(data, overrides, parse_value)
        except CompatError as exc:
            raise ParamsError(str(exc)) from None
    return params_from_dict(data, source, model)
