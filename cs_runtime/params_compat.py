"""Model-zoo params files as shipped: spellings, the 2.x `trainer:` layout, overrides.

Pure dict transforms that run before cs_runtime/config.py validates a file:

- `from_trainer(d)`: a 2.x file (`trainer: {init: ..., fit: ...}`) becomes the
  sections of a 1.x file (train_input, eval_input, model, optimizer, runconfig),
  and `origins` says where each came from, so an error names the key the user
  wrote (`trainer.init.loop.max_steps`, not `runconfig.max_steps`).
- `merge_alias(section, canonical, alias)`: the model zoo spells some keys two
  ways over its releases (`weight_decay_rate` / `weight_decay`); both mean one
  setting, and giving both with different values is an error.
- `suggest(section, key, known)`: the model-zoo spelling of a key the user
  spelled another way (`activation` -> `activation_fn`), or the closest known key.
- `apply_overrides(d, ["runconfig.max_steps=10", ...])`: run.py's --override.
"""
from __future__ import annotations

import difflib
from typing import Any

import yaml

from cs_runtime.errors import UserInputError

# Other spellings of model-zoo keys, per section: what a user coming from another
# framework (or from this project's earlier releases) writes -> the model zoo's key.
OTHER_SPELLINGS: dict[str, dict[str, str]] = {
    "model": {"activation": "activation_fn", "num_layers": "num_hidden_layers", "n_layer": "num_hidden_layers",
              "n_head": "num_heads", "num_attention_heads": "num_heads", "intermediate_size": "filter_size",
              "ffn_size": "filter_size", "n_embd": "hidden_size", "d_model": "hidden_size",
              "hidden_act": "nonlinearity", "activation_function": "nonlinearity",
              "dropout_prob": "dropout", "tie_word_embeddings": "share_embedding_weights",
              "n_positions": "max_position_embeddings", "layer_norm_eps": "layer_norm_epsilon"},
    "optimizer": {"lr": "learning_rate", "type": "optimizer_type", "optimizer": "optimizer_type",
                  "clip_grad_norm": "max_gradient_norm", "grad_clip": "max_gradient_norm",
                  "max_grad_norm": "max_gradient_norm", "adam_epsilon": "eps", "adam_beta1": "beta1",
                  "adam_beta2": "beta2"},
    "runconfig": {"steps": "max_steps", "total_steps": "max_steps", "train_steps": "max_steps",
                  "save_steps": "checkpoint_steps", "checkpoint_every": "checkpoint_steps",
                  "log_every": "log_steps", "logging_steps": "log_steps", "eval_every": "eval_frequency",
                  "epochs": "num_epochs", "random_seed": "seed"},
    "train_input": {"batch": "batch_size", "micro_batch_size": "batch_size", "workers": "num_workers",
                    "data_path": "data_dir", "seq_len": "max_sequence_length",
                    "max_seq_length": "max_sequence_length", "drop_last": "drop_last_batch"},
}
OTHER_SPELLINGS["eval_input"] = OTHER_SPELLINGS["train_input"]
TOP_LEVEL_SPELLINGS = {"train": "train_input", "eval": "eval_input", "data": "train_input",
                       "optim": "optimizer", "run": "runconfig", "run_config": "runconfig", "config": "runconfig"}


def suggest(section: str | None, key: str, known: list[str]) -> str | None:
    """The model-zoo key the user probably meant, or None."""
    table = TOP_LEVEL_SPELLINGS if section is None else OTHER_SPELLINGS.get(section, {})
    if key in table and table[key] in known:
        return table[key]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return close[0] if close else None


class CompatError(UserInputError):
    """A params dict whose layout (not a value) is wrong; the message is one line."""


def merge_alias(section: dict, canonical: str, alias: str) -> dict:
    """Fold `alias` into `canonical` (they are one setting); both with different values is an error."""
    if alias not in section:
        return section
    section = dict(section)
    value = section.pop(alias)
    if canonical in section and section[canonical] != value:
        raise ValueError(f"{alias} and {canonical} are the same setting; give one "
                         f"(got {value!r} and {section[canonical]!r})")
    section.setdefault(canonical, value)
    return section


# ---------------------------------------------------------------- the 2.x trainer layout

# trainer.init.<key> -> (section, key) of the 1.x layout, for the keys that move as they are.
_INIT_MOVES = {"seed": ("runconfig", "seed"), "model_dir": ("runconfig", "model_dir")}
_LOOP_MOVES = {"max_steps": "max_steps", "num_steps": "num_steps", "num_epochs": "num_epochs",
               "steps_per_epoch": "steps_per_epoch", "eval_frequency": "eval_frequency",
               "eval_steps": "eval_steps", "grad_accum_steps": "grad_accum_steps"}
_CHECKPOINT_MOVES = {"steps": "checkpoint_steps", "save_initial_checkpoint": "save_initial_checkpoint",
                     "checkpoint_name": None, "disable_strict_checkpoint_loading": None}
_PRECISION_MOVES = {"enabled": ("model", "mixed_precision"), "fp16_type": ("model", "fp16_type"),
                    "loss_scaling_factor": ("optimizer", "loss_scaling_factor"),
                    "initial_loss_scale": ("optimizer", "initial_loss_scale"),
                    "steps_per_increase": ("optimizer", "steps_per_increase"),
                    "min_loss_scale": ("optimizer", "min_loss_scale"),
                    "max_loss_scale": ("optimizer", "max_loss_scale"),
                    "max_gradient_norm": ("optimizer", "max_gradient_norm"),
                    "max_gradient_value": ("optimizer", "max_gradient_value"),
                    "log_loss_scale": ("optimizer", "log_summaries")}


def is_trainer_layout(d: Any) -> bool:
    return isinstance(d, dict) and "trainer" in d


def from_trainer(d: dict) -> tuple[dict, dict[str, str]]:
    """A 2.x `trainer:` params dict as 1.x sections, and for each moved key (dotted
    1.x path, or a whole section) the dotted 2.x path it came from."""
    extra = [k for k in d if k != "trainer"]
    if extra:
        raise CompatError(f"{extra[0]}: unknown key next to trainer (a 2.x file holds only trainer:)")
    trainer = d["trainer"]
    if isinstance(trainer, list):
        if len(trainer) != 1 or not isinstance(trainer[0], dict) or set(trainer[0]) != {"trainer"}:
            raise CompatError("trainer: a list of several trainers (multi-phase training) is not supported; "
                              "give one trainer")
        trainer = trainer[0]["trainer"]
    if not isinstance(trainer, dict):
        raise CompatError("trainer: expected a mapping with init: and fit:")
    unknown = [k for k in trainer if k not in ("init", "fit", "validate", "validate_all")]
    if unknown:
        raise CompatError(f"trainer.{unknown[0]}: unknown key (expected init, fit, validate, validate_all)")
    init = _mapping(trainer.get("init"), "trainer.init")
    out: dict[str, dict] = {"runconfig": {}, "optimizer": {}}
    origins: dict[str, str] = {}
    weak: set[str] = set()   # values a later (or earlier) strong one replaces

    def put(section: str, key: str, value: Any, origin: str, is_weak: bool = False) -> None:
        out.setdefault(section, {})
        where = f"{section}.{key}"
        if key in out[section] and (is_weak or where in weak):
            if not is_weak:
                out[section][key], origins[where] = value, origin
                weak.discard(where)
            return
        if is_weak:
            weak.add(where)
        if key in out[section] and out[section][key] != value:
            raise CompatError(f"{origin}: contradicts {origins[f'{section}.{key}']} "
                              f"({value!r} vs {out[section][key]!r})")
        out[section][key] = value
        origins[f"{section}.{key}"] = origin

    for key, value in init.items():
        where = f"trainer.init.{key}"
        if key in _INIT_MOVES:
            put(*_INIT_MOVES[key], value, where)
        elif key == "model":
            out["model"] = dict(_mapping(value, where))
            origins["model"] = where
        elif key == "optimizer":
            _optimizer(value, where, put)
        elif key == "schedulers":
            _schedulers(value, where, put)
        elif key == "precision":
            for pkey, pvalue in _mapping(value, where).items():
                if pkey not in _PRECISION_MOVES:
                    raise CompatError(f"{where}.{pkey}: unknown key")
                put(*_PRECISION_MOVES[pkey], pvalue, f"{where}.{pkey}")
        elif key == "loop":
            _moves(value, where, _LOOP_MOVES, "runconfig", put)
        elif key == "checkpoint":
            _moves(value, where, _CHECKPOINT_MOVES, "runconfig", put)
        elif key == "logging":
            _moves(value, where, {"log_steps": "log_steps", "log_level": None, "wsc_log_level": None,
                                  "enable_act_frequency": None}, "runconfig", put)
        elif key in ("backend", "device", "callbacks", "loggers"):
            continue   # where and how the job runs (csrun_wse's flags here); no effect on the numbers
        elif key == "sparsity":
            raise CompatError(f"{where}: sparsity is not emulated")
        else:
            raise CompatError(f"{where}: unknown key")
    fit = _mapping(trainer.get("fit"), "trainer.fit")
    for key, value in fit.items():
        where = f"trainer.fit.{key}"
        if key == "train_dataloader":
            out["train_input"] = dict(_mapping(value, where))
            origins["train_input"] = where
        elif key == "val_dataloader":
            value = value[0] if isinstance(value, list) and len(value) == 1 else value
            out["eval_input"] = dict(_mapping(value, where))
            origins["eval_input"] = where
        elif key == "ckpt_path":
            continue   # run.py's --checkpoint_path; the runner reads it from there
        else:
            raise CompatError(f"{where}: unknown key")
    return out, origins


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CompatError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _moves(value: Any, where: str, moves: dict, section: str, put) -> None:
    for key, item in _mapping(value, where).items():
        if key not in moves:
            raise CompatError(f"{where}.{key}: unknown key")
        if moves[key] is not None:
            put(section, moves[key], item, f"{where}.{key}")


def _optimizer(value: Any, where: str, put) -> None:
    """`optimizer: {AdamW: {lr: ..., betas: ...}}` -> optimizer_type adamw and its settings."""
    value = _mapping(value, where)
    if len(value) != 1:
        raise CompatError(f"{where}: expected one optimizer (e.g. AdamW: {{...}}), got {len(value)}")
    (name, settings), = value.items()
    put("optimizer", "optimizer_type", name, f"{where}.{name}")
    for key, item in _mapping(settings, f"{where}.{name}").items():
        setting = "learning_rate" if key == "lr" else key
        # A scheduler sets the learning rate of every step, so the optimizer's own gives way to it.
        put("optimizer", setting, item, f"{where}.{name}.{key}", is_weak=setting == "learning_rate")


_SCHEDULER_NAMES = {"LinearLR": "Linear", "CosineDecayLR": "CosineDecay", "ExponentialLR": "Exponential",
                    "ConstantLR": "Constant"}


def _schedulers(value: Any, where: str, put) -> None:
    """`schedulers: [SequentialLR: {schedulers: [LinearLR: {...}, CosineDecayLR: {...}]}]`
    (or one scheduler) -> the 1.x `learning_rate:` list."""
    if not isinstance(value, list) or len(value) != 1:
        raise CompatError(f"{where}: expected a list of one learning-rate scheduler")
    name, settings, at = _one_scheduler(value[0], f"{where}[0]")
    if name == "SequentialLR":
        settings = _mapping(settings, at)
        inner = settings.get("schedulers")
        if not isinstance(inner, list) or not inner:
            raise CompatError(f"{at}.schedulers: expected a list of schedulers")
        if set(settings) - {"schedulers", "milestones"}:
            raise CompatError(f"{at}.{sorted(set(settings) - {'schedulers', 'milestones'})[0]}: unknown key")
        steps = [_lr_entry(*_one_scheduler(s, f"{at}.schedulers[{i}]")) for i, s in enumerate(inner)]
        put("optimizer", "learning_rate", steps, f"{at}.schedulers")
    else:
        put("optimizer", "learning_rate", _lr_entry(name, settings, at), at)


def _one_scheduler(item: Any, where: str) -> tuple[str, Any, str]:
    if not isinstance(item, dict) or len(item) != 1:
        raise CompatError(f"{where}: expected one scheduler, e.g. LinearLR: {{...}}")
    (name, settings), = item.items()
    return name, settings, f"{where}.{name}"


def _lr_entry(name: str, settings: Any, where: str) -> dict:
    if name not in _SCHEDULER_NAMES:
        raise CompatError(f"{where}: scheduler {name} is not supported "
                          f"(supported: {', '.join(_SCHEDULER_NAMES)}, SequentialLR)")
    return {"scheduler": _SCHEDULER_NAMES[name], **_mapping(settings, where)}


# ---------------------------------------------------------------- --override


def apply_overrides(d: dict, overrides: list[str], parse) -> dict:
    """`key.path=value` set in a copy of d; `parse` reads the value (YAML: 10, 1e-3,
    true, [1, 2], null). A path into a 2.x file starts with trainer
    (trainer.init.loop.max_steps=10)."""
    import copy

    d = copy.deepcopy(d)
    for item in overrides:
        path, eq, text = item.partition("=")
        if not eq or not path or any(not part for part in path.split(".")):
            raise CompatError(f"--override {item}: expected KEY.PATH=VALUE")
        try:
            value = parse(text) if text.strip() else None
        except yaml.YAMLError:
            raise CompatError(f"--override {item}: the value is not valid YAML") from None
        node = d
        parts = path.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise CompatError(f"--override {item}: {'.'.join(parts[:i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return d
