"""Tests of cs_runtime/config.py: pure unit tests, no processes.

    python -m pytest tests/test_config.py -q
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cs_runtime.config import (
    EvalInputConfig,
    LinearSchedule,
    OptimizerConfig,
    ParamsError,
    load_params,
    params_from_dict,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/fc_mnist/configs/params.yaml"


def _error(d: Any) -> str:
    """The one-line message params_from_dict raises for `d`."""
    with pytest.raises(ParamsError) as info:
        params_from_dict(d, source="params.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("params.yaml: ")
    return msg


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


# --- the example file and defaults -------------------------------------------


def test_example_file_loads() -> None:
    p = load_params(EXAMPLE)
    assert p.train_input.data_dir is None
    assert p.train_input.batch_size == 128 and p.train_input.shuffle
    assert p.eval_input.shuffle is False and p.eval_input.drop_last_batch is False
    assert p.model.layer_sizes() == [784, 256, 128, 10]
    assert p.model.activation_fn == "relu" and p.model.dropout == 0.1
    assert p.optimizer.optimizer_type == "sgd"
    assert p.optimizer.lr_at(0) == 0.02 and p.optimizer.momentum == 0.9
    assert p.optimizer.max_gradient_norm is None
    rc = p.runconfig
    assert (rc.max_steps, rc.log_steps, rc.checkpoint_steps) == (200, 20, 100)
    assert (rc.seed, rc.max_checkpoints) == (1, 3)


def test_defaults() -> None:
    p = params_from_dict({})
    assert p.train_input.shuffle is True and p.eval_input.shuffle is False
    assert isinstance(p.eval_input, EvalInputConfig)
    for section in (p.train_input, p.eval_input):
        assert section.batch_size == 128 and section.drop_last_batch is True
        assert section.data_dir is None and section.num_workers == 0
        assert section.shuffle_seed is None
    assert p.model.hidden_sizes == [256, 128]
    assert p.model.layer_sizes() == [784, 256, 128, 10]
    assert p.model.activation_fn == "relu" and p.model.dropout == 0.0
    opt = p.optimizer
    assert (opt.optimizer_type, opt.learning_rate, opt.momentum) == ("sgd", 0.01, 0.0)
    assert opt.betas == (0.9, 0.999) and opt.eps == 1e-6     # the model zoo's Adam eps
    assert opt.exclude_bias_and_norm
    assert opt.max_gradient_norm is None and opt.weight_decay == 0.0
    rc = p.runconfig
    assert (rc.stop_step(0), rc.log_steps, rc.checkpoint_steps, rc.seed) == (100, 10, 0, 1)
    assert rc.max_checkpoints == 5 and rc.eval_steps is None
    assert rc.execution_strategy is None
    assert p.csconfig.wafer_memory_bytes is None


def test_shuffle_seed_falls_back_to_run_seed() -> None:
    p = params_from_dict({"train_input": {"shuffle_seed": 7}, "runconfig": {"seed": 3}})
    assert p.train_input.seed(p.runconfig.seed) == 7
    assert p.eval_input.seed(p.runconfig.seed) == 3


def test_empty_file_is_an_error_and_empty_section_takes_defaults(tmp_path: Path) -> None:
    for text in ("", "# nothing\n", "{}\n"):
        with pytest.raises(ParamsError, match=r"params\.yaml: the params file is empty"):
            load_params(_write(tmp_path, text))
    p = load_params(_write(tmp_path, "runconfig:\n  # max_steps: 5\n"))
    assert p.runconfig.stop_step(0) == 100


def test_ints_are_accepted_for_floats() -> None:
    p = params_from_dict({"optimizer": {"learning_rate": 1, "momentum": 0}})
    assert p.optimizer.learning_rate == 1.0 and isinstance(p.optimizer.momentum, float)


def test_scientific_notation_is_a_number_in_yaml(tmp_path: Path) -> None:
    # PyYAML alone reads `1e-3` as a string (YAML 1.1); the loader fixes that.
    p = load_params(_write(tmp_path, "optimizer:\n  learning_rate: 1e-3\n  eps: 1E-7\n"))
    assert p.optimizer.learning_rate == 1e-3 and p.optimizer.eps == 1e-7


# --- errors -------------------------------------------------------------------


def test_unknown_top_level_section() -> None:
    assert _error({"trian_input": {}}) == "params.yaml: trian_input: unknown key: did you mean train_input?"


def test_unknown_nested_key() -> None:
    msg = _error({"model": {"hiden_sizes": [3]}})
    assert msg == "params.yaml: model.hiden_sizes: unknown key: did you mean hidden_sizes?"
    assert _error({"model": {"zzz": 1}}) == "params.yaml: model.zzz: unknown key"   # nothing close


def test_wrong_type_string_for_number() -> None:
    msg = _error({"optimizer": {"learning_rate": "abc"}})
    assert msg == (
        "params.yaml: optimizer.learning_rate: Input should be a valid number (got 'abc')"
    )


@pytest.mark.parametrize(
    "d, path",
    [
        ({"runconfig": {"max_steps": "100"}}, "runconfig.max_steps"),
        ({"runconfig": {"max_steps": 10.5}}, "runconfig.max_steps"),
        ({"runconfig": {"max_steps": 10.0}}, "runconfig.max_steps"),
        ({"runconfig": {"seed": True}}, "runconfig.seed"),
        ({"train_input": {"shuffle": "yes"}}, "train_input.shuffle"),
        ({"train_input": {"shuffle": 1}}, "train_input.shuffle"),
        ({"eval_input": {"data_dir": 3}}, "eval_input.data_dir"),
        ({"optimizer": {"momentum": "0.9"}}, "optimizer.momentum"),
        ({"model": {"hidden_sizes": [256, "x"]}}, "model.hidden_sizes[1]"),
        ({"model": {"activation_fn": "swish"}}, "model.activation_fn"),
        ({"optimizer": {"optimizer_type": "adagrad"}}, "optimizer.optimizer_type"),
        ({"runconfig": {"execution_strategy": "both"}}, "runconfig.execution_strategy"),
        ({"model": 5}, "model"),
    ],
)
def test_wrong_type(d: dict[str, Any], path: str) -> None:
    assert _error(d).startswith(f"params.yaml: {path}: ")


@pytest.mark.parametrize(
    "d, path",
    [
        ({"train_input": {"batch_size": 0}}, "train_input.batch_size"),
        ({"train_input": {"num_workers": -1}}, "train_input.num_workers"),
        ({"model": {"dropout": 1.0}}, "model.dropout"),
        ({"model": {"dropout": -0.1}}, "model.dropout"),
        ({"model": {"num_classes": 1}}, "model.num_classes"),
        ({"model": {"depth": 0, "hidden_size": 4}}, "model.depth"),
        ({"model": {"hidden_sizes": [256, 0]}}, "model.hidden_sizes[1]"),
        ({"optimizer": {"learning_rate": 0}}, "optimizer.learning_rate"),
        ({"optimizer": {"learning_rate": float("nan")}}, "optimizer.learning_rate"),
        ({"optimizer": {"weight_decay": -1e-4}}, "optimizer.weight_decay"),
        ({"optimizer": {"max_gradient_norm": 0.0}}, "optimizer.max_gradient_norm"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]"),
        ({"optimizer": {"eps": 0}}, "optimizer.eps"),
        ({"runconfig": {"checkpoint_steps": -1}}, "runconfig.checkpoint_steps"),
        ({"runconfig": {"max_checkpoints": 0}}, "runconfig.max_checkpoints"),
        ({"runconfig": {"eval_steps": 0}}, "runconfig.eval_steps"),
    ],
)
def test_out_of_range(d: dict[str, Any], path: str) -> None:
    assert _error(d).startswith(f"params.yaml: {path}: ")


def test_out_of_range_message_shows_value() -> None:
    msg = _error({"train_input": {"batch_size": -4}})
    assert msg == "params.yaml: train_input.batch_size: Input should be greater than 0 (got -4)"


def test_both_hidden_spellings() -> None:
    msg = _error({"model": {"hidden_sizes": [8], "depth": 2, "hidden_size": 4}})
    assert msg.startswith("params.yaml: model: ")
    assert "hidden_sizes" in msg and "depth" in msg


def test_depth_without_hidden_size() -> None:
    msg = _error({"model": {"depth": 2}})
    assert msg.startswith("params.yaml: model: ") and "hidden_size" in msg


def test_schedule_errors_name_the_nested_key() -> None:
    base = {"scheduler": "Linear", "initial_learning_rate": 0.1, "end_learning_rate": 0.0}
    msg = _error({"optimizer": {"learning_rate": {**base, "total_iters": 0}}})
    assert msg.startswith("params.yaml: optimizer.learning_rate.total_iters: ")
    msg = _error({"optimizer": {"learning_rate": {**base, "total_iters": 5, "gamma": 1}}})
    assert msg == "params.yaml: optimizer.learning_rate.gamma: unknown key"
    msg = _error({"optimizer": {"learning_rate": {**base, "scheduler": "Polynomial",
                                                  "total_iters": 5}}})
    assert msg.startswith("params.yaml: optimizer.learning_rate.scheduler: ")
    msg = _error({"optimizer": {"learning_rate": {**base, "total_iters": 5,
                                                  "decay_steps": 5}}})
    assert msg.startswith("params.yaml: optimizer.learning_rate: ")


def test_several_errors_are_all_reported_a_line_each() -> None:
    with pytest.raises(ParamsError) as info:
        params_from_dict({"runconfig": {"max_steps": "x", "log_steps": 0, "seed": "y"},
                          "model": {"activation": "relu"}}, source="params.yaml")
    assert info.value.lines == [
        "params.yaml: model.activation: unknown key: did you mean activation_fn?",
        "params.yaml: runconfig.max_steps: Input should be a valid integer (got 'x')",
        "params.yaml: runconfig.log_steps: Input should be greater than 0 (got 0)",
        "params.yaml: runconfig.seed: Input should be a valid integer (got 'y')",
    ]
    assert str(info.value) == "\n".join(info.value.lines)


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"params\.yaml: top level must be a mapping"):
        load_params(_write(tmp_path, "- a\n- b\n"))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ParamsError, match=r"nope\.yaml: no such file"):
        load_params(path)


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ParamsError) as info:
        load_params(_write(tmp_path, "model:\n  hidden_sizes: [1, 2\n"))
    msg = str(info.value)
    assert "\n" not in msg and "params.yaml: invalid YAML at line" in msg


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="duplicate key 'seed'"):
        load_params(_write(tmp_path, "runconfig:\n  seed: 1\n  seed: 2\n"))


def test_load_validation_error_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "optimizer:\n  learning_rate: abc\n")
    with pytest.raises(ParamsError) as info:
        load_params(path)
    assert str(info.value) == (
        f"{path}: optimizer.learning_rate: Input should be a valid number (got 'abc')"
    )


# --- spellings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "given, stored", [("SGD", "sgd"), ("Adam", "adam"), ("AdamW", "adamw"), ("adamw", "adamw")]
)
def test_capitalised_optimizer_names(given: str, stored: str) -> None:
    p = params_from_dict({"optimizer": {"optimizer_type": given}})
    assert p.optimizer.optimizer_type == stored


def test_activation_case_insensitive() -> None:
    assert params_from_dict({"model": {"activation_fn": "GELU"}}).model.activation_fn == "gelu"


def test_layer_sizes_both_spellings() -> None:
    listed = params_from_dict({"model": {"hidden_sizes": [64, 32, 16]}}).model
    assert listed.layer_sizes() == [784, 64, 32, 16, 10]
    stacked = params_from_dict(
        {"model": {"depth": 3, "hidden_size": 50, "input_size": 20, "num_classes": 4}}
    ).model
    assert stacked.layer_sizes() == [20, 50, 50, 50, 4]


# --- learning rate ------------------------------------------------------------


def test_lr_constant() -> None:
    opt = OptimizerConfig(learning_rate=0.05)
    assert [opt.lr_at(s) for s in (0, 1, 10**6)] == [0.05, 0.05, 0.05]


def _linear(**keys: Any) -> OptimizerConfig:
    sched = {"scheduler": "Linear", "initial_learning_rate": 0.1,
             "end_learning_rate": 0.02, **keys}
    return params_from_dict({"optimizer": {"learning_rate": sched}}).optimizer


def test_lr_linear() -> None:
    opt = _linear(total_iters=100)
    assert isinstance(opt.learning_rate, LinearSchedule)
    assert opt.lr_at(0) == 0.1
    assert opt.lr_at(50) == pytest.approx(0.06)
    assert opt.lr_at(25) == pytest.approx(0.08)
    assert opt.lr_at(100) == 0.02  # exactly the end value
    assert opt.lr_at(1000) == 0.02


def test_lr_linear_is_a_pure_function_of_step() -> None:
    a, b = _linear(total_iters=7), _linear(total_iters=7)
    assert [a.lr_at(s) for s in range(10)] == [b.lr_at(s) for s in range(10)]
    assert a.lr_at(3) == a.lr_at(3)


def test_lr_decay_steps_alias() -> None:
    assert _linear(decay_steps=10).lr_at(5) == _linear(total_iters=10).lr_at(5)


def test_lr_negative_step() -> None:
    with pytest.raises(ValueError):
        OptimizerConfig().lr_at(-1)


# --- to_dict ------------------------------------------------------------------


@pytest.mark.parametrize(
    "d",
    [
        {},
        {"model": {"depth": 2, "hidden_size": 8}, "optimizer": {"optimizer_type": "Adam"}},
        {"optimizer": {"learning_rate": {"scheduler": "Linear", "initial_learning_rate": 0.1,
                                         "end_learning_rate": 0.0, "decay_steps": 5}},
         "runconfig": {"execution_strategy": "pipelined", "eval_steps": 3}},
        {"csconfig": {"wafer_memory_bytes": 1000000}},
    ],
)
def test_to_dict_round_trips(d: dict[str, Any]) -> None:
    p = params_from_dict(d)
    out = p.to_dict()
    assert json.loads(json.dumps(out)) == out  # JSON-able: no tuples, no objects
    assert params_from_dict(out) == p
    assert params_from_dict(out).to_dict() == out


def test_example_round_trips() -> None:
    p = load_params(EXAMPLE)
    assert params_from_dict(p.to_dict()) == p


# --- csconfig -----------------------------------------------------------------


def test_csconfig_wafer_memory() -> None:
    assert params_from_dict({"csconfig": {"wafer_memory_bytes": 4096}}).csconfig.wafer_memory_bytes == 4096
    assert _error({"csconfig": {"wafer_memory_bytes": 0}}).startswith(
        "params.yaml: csconfig.wafer_memory_bytes: ")
    assert "unknown key" in _error({"csconfig": {"wafer_memory": 1}})
