"""Every shipped params file of FC-MNIST, GPT-2 and BERT, at every model zoo
release tag from 1.8 to 2.10, validates with the project's own examples:
each key honoured with its meaning or accepted and named as not modelled.

tests/modelzoo_params/releases/ holds, written here, the keys and values of
the files as the tags hold them (not the files: no third-party text is kept),
one fixture per distinct content; MANIFEST.txt says which tag shipped which file
(FC-MNIST PyTorch and, in 1.8, TF; the PyTorch GPT-2 and BERT pre-training
configs; the model zoo ships no GPT-2 params file from 2.4 on).

    python -m pytest tests/test_modelzoo_releases.py -q
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cs_runtime.config import ParamsError, load_params, params_from_dict, read_params_file
from cs_runtime.lm_checks import gpt2_loss
from cs_runtime.run_args import parse_args
from cs_runtime.launch import target

RELEASES = Path(__file__).resolve().parent / "modelzoo_params" / "releases"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def manifest() -> list[tuple[str, str, str, Path]]:
    rows = []
    for line in (RELEASES / "MANIFEST.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            tag, model, shipped, fixture = line.split()
            rows.append((tag, model, shipped, RELEASES / fixture))
    return rows


TAGS = sorted({row[0] for row in manifest()}, key=lambda t: tuple(int(x) for x in t.split("_")[1].split(".")))


def example(model: str):
    spec = importlib.util.spec_from_file_location(f"example_{model}", EXAMPLES / model / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_manifest_covers_every_release_from_1_8() -> None:
    assert TAGS[0] == "Release_1.8.0" and TAGS[-1] == "Release_2.10.0" and len(TAGS) == 19
    for tag in TAGS:
        models = {row[1] for row in manifest() if row[0] == tag}
        assert models >= {"fc_mnist", "bert"} or tag.startswith("Release_2.4")   # 2.4.x ship no FC-MNIST params
    assert len(manifest()) == 185


@pytest.mark.parametrize("tag", TAGS)
def test_every_shipped_file_of_a_release_validates_with_our_examples(tag: str) -> None:
    builders = {m: example(m).model_fn for m in ("fc_mnist", "gpt2", "bert")}
    for _, model, shipped, fixture in (row for row in manifest() if row[0] == tag):
        params = load_params(fixture, model)
        spec = builders[model](params)       # the example's own checks, then the model it builds
        assert spec.layers, shipped
        for line in params.not_modelled:     # each named with why
            assert " (" in line and line.endswith(")"), line


def only(tag: str, shipped_end: str) -> Path:
    found = [row[3] for row in manifest() if row[0] == tag and row[2].endswith(shipped_end)]
    assert len(found) == 1, found
    return found[0]


def test_gpt2_r19_keys_of_1_x_are_honoured_or_named() -> None:
    p = load_params(only("Release_1.9.1", "params_gpt2_small.yaml"), "gpt2")
    assert gpt2_loss(p) == {"loss_scaling": "batch_size", "loss_weight": 0.00048828125}
    assert p.optimizer.correct_bias and p.model.use_position_embedding
    assert [line.split(" (")[0] for line in p.not_modelled] == ["optimizer.learning_rate[1].alpha"]
    spec = example("gpt2").model_fn(p)
    assert (spec.loss_scaling, spec.loss_weight) == ("batch_size", 0.00048828125)


def test_gpt2_num_tokens_with_a_loss_weight_falls_back_to_batch_size_as_the_model_zoo() -> None:
    p = params_from_dict({"model": {"loss_scaling": "num_tokens", "loss_weight": 0.5}}, model="gpt2")
    assert gpt2_loss(p) == {"loss_scaling": "batch_size", "loss_weight": 0.5}
    assert gpt2_loss(params_from_dict({"model": {}}, model="gpt2")) == {"loss_scaling": "num_tokens",
                                                                        "loss_weight": 1.0}


def test_gpt2_batch_size_scaling_is_the_sum_times_loss_weight_over_the_batch() -> None:
    from tests.dense_reference import model_loss
    model = {"vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2, "filter_size": 16,
             "max_position_embeddings": 6, "dropout_rate": 0.0, "attention_dropout_rate": 0.0,
             "loss_scaling": "batch_size", "loss_weight": 0.25}
    spec = example("gpt2").model_fn(params_from_dict({"model": model}, model="gpt2"))
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 6, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 6))
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    summed = -np.take_along_axis(logp, labels[..., None], -1).sum()
    assert model_loss(spec, logits, labels, global_batch=2, label_count=12).loss == pytest.approx(
        0.25 * summed / 2, rel=1e-6)


def test_fc_mnist_2_x_scheduler_sets_the_rate_and_split_picks_the_digits() -> None:
    p = load_params(only("Release_2.10.0", "params_cszoov2.yaml"), "fc_mnist")
    assert p.optimizer.lr_at(0) == p.optimizer.lr_at(999) == 0.001     # ConstantLR over SGD's own lr
    assert (p.train_input.split, p.eval_input.split) == ("train", "val")
    split = example("fc_mnist").mnist_split
    assert (split(p.train_input, "train"), split(p.eval_input, "test")) == ("train", "test")
    # A scheduler with another rate than the optimizer's: the scheduler's, as torch applies it.
    d = read_params_file(only("Release_2.10.0", "params_cszoov2.yaml"))
    d["trainer"]["init"]["schedulers"][0]["ConstantLR"]["learning_rate"] = 0.5
    assert params_from_dict(d, model="fc_mnist").optimizer.lr_at(0) == 0.5


def test_fc_mnist_r19_stops_at_the_first_length_it_reaches() -> None:
    p = load_params(only("Release_1.9.1", "fc_mnist/pytorch/configs/params.yaml"), "fc_mnist")
    rc = p.runconfig
    assert (rc.num_epochs, rc.steps_per_epoch, rc.max_steps) == (1, 1000, 10000)
    assert rc.stop_step(0) == 1000


def test_a_key_twice_with_the_same_value_is_one_key(tmp_path: Path) -> None:
    p = load_params(only("Release_1.8.0", "params_gpt2_small_ws.yaml"), "gpt2")   # `steps: 150000` twice
    assert p.optimizer.learning_rate[1].steps == 150000
    twice = tmp_path / "twice.yaml"
    twice.write_text("runconfig:\n  max_steps: 10\n  max_steps: 20\n")
    with pytest.raises(ParamsError, match=r"duplicate key 'max_steps' with another value \(line 3\)"):
        load_params(twice)


@pytest.mark.parametrize("section, line", [
    ({"train_input": {"vocab_size": 99}, "model": {"vocab_size": 50}},
     "params.yaml: train_input.vocab_size 99 differs from model.vocab_size 50"),
    ({"train_input": {"repeat": False}},
     "params.yaml: train_input.repeat: false is not emulated: training data repeats for as many steps as the run "
     "takes"),
    ({"model": {"use_position_embedding": False}},
     "params.yaml: model.use_position_embedding: a GPT-2 without position embeddings is not emulated (got False)"),
    ({"optimizer": {"use_bias_correction": False}},
     "params.yaml: optimizer: correct_bias: false (Adam without bias correction) is not emulated"),
])
def test_what_cannot_be_honoured_is_one_line(section: dict, line: str) -> None:
    with pytest.raises(ParamsError) as info:
        params_from_dict(section, "params.yaml", "gpt2")
    assert info.value.lines == [line]


def test_run_py_names_the_keys_not_modelled_once(capsys: pytest.CaptureFixture) -> None:
    path = only("Release_1.8.0", "bert_base_MSL128.yaml")
    args = parse_args(["CPU", "--mode", "train", "--params", str(path)], "bert")
    assert target.hand_over(args) is None   # CPU: go on in this process
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{path}: accepted, not modelled: ")
    assert "train_input.buckets (VTS length buckets" in err[0] and "model.enable_vts (variable" in err[0]
