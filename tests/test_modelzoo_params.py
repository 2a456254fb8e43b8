"""Model-zoo params files as shipped (tests/modelzoo_params/: our own files in the
shape of the model zoo's FC-MNIST PyTorch/TF, GPT-2 small and BERT base configs,
releases 1.8, 2.0-2.3 and the 2.x trainer layout).

    python -m pytest tests/test_modelzoo_params.py -q
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cs_runtime.config import ParamsError, load_params, params_from_dict
from cs_runtime.data.inputs import InputStream
from cs_runtime.data.text import BertDataset, TextDataError, load_corpus
from cs_runtime.lm_checks import gpt2_loss, mlm_loss_scaling, mlm_loss_weight
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from worker.input_worker import fetched_ahead

from tests.cluster_utils import tool, train_losses

REPO = Path(__file__).resolve().parents[1]
FILES = REPO / "tests" / "modelzoo_params"
SCRIPT = {"fc_mnist": REPO / "examples/fc_mnist/run.py", "gpt2": REPO / "examples/gpt2/run.py",
          "bert": REPO / "examples/bert/run.py"}
SHIPPED = [("fc_mnist_pytorch_r18", "fc_mnist"), ("fc_mnist_pytorch_r20", "fc_mnist"), ("fc_mnist_tf", "fc_mnist"),
           ("gpt2_small_r18", "gpt2"), ("gpt2_small_trainer", "gpt2"), ("bert_base_r18", "bert"),
           ("bert_base_trainer", "bert")]


def lines_of(exc: pytest.ExceptionInfo) -> list[str]:
    return exc.value.lines


def error_lines(d: dict, model: str | None = None) -> list[str]:
    with pytest.raises(ParamsError) as info:
        params_from_dict(d, "params.yaml", model)
    return lines_of(info)


def run_script(model: str, params: Path, model_dir: Path, *extra: str, mode: str = "train",
               launcher: str = "csrun_cpu", timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [tool(launcher), *(["--num_workers_per_csx", "1"] if launcher == "csrun_wse" else []),
           sys.executable, str(SCRIPT[model]), "--mode", mode, "--params", str(params),
           "--model_dir", str(model_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=model_dir.parent)


def token_data(folder: Path, vocab: int, n: int = 4000, seed: int = 0) -> str:
    """Pre-tokenised ids below `vocab` in folder/{train,val} (as *.npy shards)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        (folder / split).mkdir(parents=True, exist_ok=True)
        # A repeating pattern, so the loss can fall.
        ids = (np.arange(n) * 7 + rng.integers(0, 3, n)) % vocab
        np.save(folder / split / "shard0.npy", ids.astype(np.int32))
    return str(folder)


# ------------------------------------------------------------------ the files as shipped


@pytest.mark.parametrize("name, model", SHIPPED)
def test_shipped_shapes_pass_the_params_schema(name: str, model: str) -> None:
    p = load_params(FILES / f"{name}.yaml", model)
    assert p.runconfig.stop_step(0) >= 1000
    assert p.train_input.batch_size >= 4


def test_gpt2_r18_keys_mean_what_they_mean_there() -> None:
    """Release_1.8.0's params_gpt2_small.yaml as the tag holds it."""
    p = load_params(FILES / "gpt2_small_r18.yaml", "gpt2")
    o = p.optimizer
    assert (o.optimizer_type, o.betas, o.weight_decay) == ("adamw", (0.9, 0.999), 0.01)
    assert o.exclude_bias_and_norm and o.max_gradient_norm is None
    # Linear warm-up over 2000 steps, then linear decay over 998000, each counting from 0.
    assert o.lr_at(0) == 0.0 and math.isclose(o.lr_at(1000), 5e-5)
    assert o.lr_at(2000) == 1e-4 and math.isclose(o.lr_at(2000 + 499000), 5e-5)
    assert o.lr_at(10 ** 6) == 0.0
    rc = p.runconfig
    assert rc.save_initial_checkpoint and rc.stop_step(0) == 10 ** 6 and rc.eval_steps == 233
    assert p.model.vocab_size == 50257 and p.model.share_embedding_weights is True
    assert p.train_input.num_workers == 8 and p.train_input.data_processor == "GptHDF5DataProcessor"
    assert p.precision == "float16" and p.train_input.max_sequence_length == 1024
    # The loss: the sum over tokens * loss_weight (1/1024) / batch_size, as the model zoo's GPTLMHeadModelLoss.
    assert gpt2_loss(p) == {"loss_scaling": "batch_size", "loss_weight": 0.0009765625}
    assert p.model.use_position_embedding is True
    assert [line.split(" (")[0] for line in p.not_modelled] == ["model.allow_multireplica"]


def test_trainer_layout_maps_onto_the_same_settings() -> None:
    old = load_params(FILES / "gpt2_small_r18.yaml", "gpt2")
    new = load_params(FILES / "gpt2_small_trainer.yaml", "gpt2")
    assert new.model.hidden_size == old.model.hidden_size == 768
    assert new.optimizer.betas == (0.9, 0.95) and new.optimizer.weight_decay == old.optimizer.weight_decay == 0.01
    assert new.precision == "cbfloat16" and new.optimizer.loss_scaling_mode() == "dynamic"
    assert new.optimizer.max_gradient_norm == 1.0
    # SequentialLR(LinearLR, CosineDecayLR): warm-up, then cosine from 0.0006 to 0.
    o = new.optimizer
    assert o.lr_at(1600) == 0.0006 and math.isclose(o.lr_at(1600 + 75000), 0.0003)
    assert math.isclose(o.lr_at(1600 + 37500), 0.0003 * (1 + math.cos(math.pi / 4)))
    rc = new.runconfig
    assert (rc.max_steps, rc.eval_frequency, rc.eval_steps, rc.checkpoint_steps) == (151600, 10000, 32, 10000)
    assert rc.save_initial_checkpoint and rc.log_steps == 100 and rc.seed == 1
    assert new.train_input.batch_size == 112 and new.eval_input.data_dir.endswith("val_msl2048")


def test_bert_r18_spellings() -> None:
    """Release_1.8.0's bert_base_MSL128.yaml as the tag holds it."""
    p = load_params(FILES / "bert_base_r18.yaml", "bert")
    assert p.optimizer.weight_decay == 0.01                       # weight_decay_rate
    assert p.precision == "float16"                               # mixed_precision, no use_bfloat16
    # disable_lr_steps_reset: true: the second piece is computed at the global step, not from 0.
    o = p.optimizer
    assert o.lr_at(3200) == pytest.approx(3.2e-5)
    assert o.lr_at(15000) == pytest.approx(1e-4 * (1 - 15000 / 1e6))
    assert o.model_copy(update={"disable_lr_steps_reset": False}).lr_at(15000) == pytest.approx(1e-4 * (1 - 5000 / 1e6))
    assert p.train_input.max_predictions_per_seq == 20 and p.train_input.do_lower
    # dynamic_mlm_scale: the loss is the mean over the masked tokens, and mlm_loss_weight goes unused.
    assert (mlm_loss_scaling(p), mlm_loss_weight(p)) == ("num_masked", 1.0)
    assert sorted(line.split(" (")[0] for line in p.not_modelled) == ["model.enable_vts", "train_input.buckets"]


def test_fc_mnist_tf_trains_with_adam_and_tf_spellings() -> None:
    p = load_params(FILES / "fc_mnist_tf.yaml", "fc_mnist")
    assert p.optimizer.optimizer_type == "adam" and p.optimizer.eps == 1e-8
    rc = p.runconfig
    assert (rc.log_steps, rc.checkpoint_steps, rc.max_checkpoints) == (500, 10000, 2)
    assert p.model.layer_sizes() == [784, 500, 300, 10]
    # No eval_input: the TF model evaluates train_input's data_dir (test split), same batch size.
    e = p.eval_input
    assert (e.data_dir, e.batch_size, e.shuffle, e.drop_last_batch) == ("./tfds", 256, False, True)
    # Without a script saying FC-MNIST, an optimizer section keeps the project's SGD default.
    assert params_from_dict({"optimizer": {"learning_rate": 0.1}}).optimizer.optimizer_type == "sgd"


def test_fc_mnist_r18_maps_16_bit_inputs_onto_mixed_precision() -> None:
    p = load_params(FILES / "fc_mnist_pytorch_r18.yaml", "fc_mnist")
    assert p.precision == "float16" and p.train_input.to_float16 is None
    assert p.model.layer_sizes() == [784] + [50] * 10 + [10]
    new = load_params(FILES / "releases/Release_2.7.0/fc_mnist__params.yaml", "fc_mnist")
    assert new.precision == "float16" and new.train_input.to_float16
    lines = error_lines({"train_input": {"to_float16": True}, "model": {"mixed_precision": False}})
    assert lines == ["params.yaml: train_input.to_float16: true needs model.mixed_precision: true (16-bit inputs "
                     "to a float32 model are not emulated)"]


# ------------------------------------------------------------------ every error at once


def test_every_wrong_key_is_one_line_with_the_model_zoo_spelling() -> None:
    lines = error_lines({"model": {"activation": "relu", "lr": 1},
                         "optimizer": {"lr": 0.1, "beta1": 2.0},
                         "runconfig": {"max_step": 10}}, "fc_mnist")
    assert sorted(lines) == sorted([
        "params.yaml: model.activation: unknown key: did you mean activation_fn?",
        "params.yaml: model.lr: unknown key",
        "params.yaml: optimizer.lr: unknown key: did you mean learning_rate?",
        "params.yaml: optimizer.betas[0]: Input should be less than 1 (got 2.0)",
        "params.yaml: runconfig.max_step: unknown key: did you mean max_steps?",
    ])


def test_settings_that_cannot_be_honoured_are_refused_with_a_reason() -> None:
    lines = error_lines({"model": {"position_embedding_type": "rotary", "use_ffn_bias": False},
                         "optimizer": {"grad_accum_steps": 2, "max_gradient_value": 1.0, "correct_bias": False},
                         "runconfig": {"autoload_last_checkpoint": False}}, "gpt2")
    joined = "\n".join(lines)
    assert "model.position_embedding_type: only learned position embeddings are emulated (got 'rotary')" in joined
    assert "model.use_ffn_bias: bias-free attention and MLP layers are not emulated (got False)" in joined
    assert "correct_bias: false (Adam without bias correction) is not emulated" in joined
    assert "runconfig: autoload_last_checkpoint: false is not emulated" in joined
    assert all(line.startswith("params.yaml: ") for line in lines)


def test_the_model_section_follows_the_script_and_names_must_agree() -> None:
    gpt = {"model": {"vocab_size": 300, "nonlinearity": "gelu"}}
    assert params_from_dict(gpt, model="gpt2").model.vocab_size == 300
    assert error_lines(gpt, "fc_mnist")[0] == "params.yaml: model.vocab_size: unknown key"
    assert error_lines({"model": {"name": "bert"}}, "gpt2") == [
        "params.yaml: model.name: 'bert', but this script builds gpt2"]
    # Older files say the model with model_type, which is still read where no script says.
    assert type(params_from_dict({"model": {"model_type": "gpt2"}}).model).__name__ == "GPT2ModelConfig"


def test_trainer_errors_name_the_key_as_written(tmp_path: Path) -> None:
    d = yaml.safe_load((FILES / "gpt2_tiny_trainer.yaml").read_text())
    d["trainer"]["init"]["loop"]["max_steps"] = "many"
    d["trainer"]["init"]["model"]["num_layers"] = 2
    lines = error_lines(d, "gpt2")
    assert "params.yaml: trainer.init.model.num_layers: unknown key: did you mean num_hidden_layers?" in lines
    assert "params.yaml: trainer.init.loop.max_steps: Input should be a valid integer (got 'many')" in lines
    d["trainer"]["init"]["loop"]["max_step"] = 5
    assert error_lines(d, "gpt2") == ["params.yaml: trainer.init.loop.max_step: unknown key"]


def test_aliases_must_agree() -> None:
    assert error_lines({"optimizer": {"weight_decay": 0.1, "weight_decay_rate": 0.2}}) == [
        "params.yaml: optimizer: weight_decay_rate and weight_decay are the same setting; give one "
        "(got 0.2 and 0.1)"]
    assert "contradict betas" in error_lines({"optimizer": {"beta1": 0.8, "betas": [0.9, 0.99]}})[0]
    p = params_from_dict({"optimizer": {"epsilon": 1e-7, "weight_decay_rate": 0.1}})
    assert p.optimizer.eps == 1e-7 and p.optimizer.weight_decay == 0.1


@pytest.mark.cluster
def test_empty_params_file_is_an_error_on_the_command_line(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("# nothing here\n")
    result = run_script("fc_mnist", params, tmp_path / "model_dir", "--validate_only")
    assert result.returncode == 2
    assert result.stderr.strip().endswith("the params file is empty (a model-zoo params file has train_input, "
                                          "model, optimizer and runconfig sections)")


@pytest.mark.cluster
def test_run_py_lists_every_error_once_and_exits_2(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": {"activation": "relu", "depth": 2, "hidden_size": 8},
                                      "optimizer": {"optimizer_type": "sgd", "learning_rate": "fast"},
                                      "runconfig": {"max_steps": 0}}))
    result = run_script("fc_mnist", params, tmp_path / "model_dir", "--validate_only")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {params}: model.activation: unknown key: did you mean activation_fn?",
                      f"error: {params}: optimizer.learning_rate: Input should be a valid number (got 'fast')",
                      f"error: {params}: runconfig.max_steps: Input should be greater than 0 (got 0)"]


@pytest.mark.cluster
def test_csrun_wse_checks_the_params_before_starting_anything(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": {"activation": "relu"}, "runconfig": {"max_step": 3}}))
    result = run_script("fc_mnist", params, tmp_path / "model_dir", launcher="csrun_wse", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    for wrong in ("model.activation: unknown key: did you mean activation_fn?",
                  "runconfig.max_step: unknown key: did you mean max_steps?"):
        assert out.count(wrong) == 1, out
    assert "wsjob" not in out and "worker" not in out.lower(), out     # nothing started, no worker blamed
    assert not (tmp_path / "model_dir").exists()


@pytest.mark.cluster
def test_csrun_wse_validate_only_starts_no_services(tmp_path: Path) -> None:
    result = run_script("fc_mnist", FILES / "fc_mnist_pytorch_r20.yaml", tmp_path / "model_dir", "--validate_only",
                        launcher="csrun_wse", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "fc_mnist is valid: 11 layers" in out and "wsjob" not in out, out


# ------------------------------------------------------------------ --validate_only and training as shipped


@pytest.mark.parametrize("name", ["fc_mnist_pytorch_r18", "fc_mnist_pytorch_r20", "fc_mnist_tf"])
@pytest.mark.cluster
def test_fc_mnist_files_validate_as_shipped(tmp_path: Path, name: str) -> None:
    result = run_script("fc_mnist", FILES / f"{name}.yaml", tmp_path / "model_dir", "--validate_only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fc_mnist is valid" in result.stdout


@pytest.mark.cluster
def test_language_model_files_validate_as_shipped(tmp_path: Path) -> None:
    """GPT-2 small and BERT base validate as shipped, the tied head, the 16-bit setting and
    BERT's next-sentence head (disable_nsp left at its default, false) included."""
    for name, positions in (("gpt2_small_trainer", 2048), ("gpt2_small_r18", 1024)):
        result = run_script("gpt2", FILES / f"{name}.yaml", tmp_path / "model_dir", "--validate_only")
        assert result.returncode == 0, result.stdout + result.stderr
        # GPT-2 small, tied and without an output bias, each parameter once: HF's 124,439,808
        # (1024 positions), and 1024 more positions of width 768 where max_position_embeddings is 2048
        assert f"gpt2 is valid: 14 layers, {124_439_808 + (positions - 1024) * 768:,} parameters" in result.stdout
    for name in ("bert_base_r18", "bert_base_trainer"):
        result = run_script("bert", FILES / f"{name}.yaml", tmp_path / "model_dir", "--validate_only")
        assert result.returncode == 0, result.stdout + result.stderr
        # BERT base pre-training, tied head, with the next-sentence head: HF's BertForPreTraining,
        # 110,106,428 (segment table, pooler and the 2-way classifier included)
        assert f"bert is valid: 15 layers, {110_106_428:,} parameters" in result.stdout, result.stdout
    result = run_script("bert", FILES / "bert_base_trainer.yaml", tmp_path / "model_dir", "--validate_only",
                        "--override", "trainer.init.model.disable_nsp=true")
    assert result.returncode == 0, result.stdout + result.stderr
    # Masked LM only: 109,514,298 (HF's BertForMaskedLM) less its 2 segment embeddings
    assert f"bert is valid: 14 layers, {109_514_298 - 2 * 768:,} parameters" in result.stdout


# The shipped GPT-2 small / BERT base shrunk to test size: only sizes, data, steps (BERT keeps
# its next-sentence head; float32, so the 1e-5 comparison holds:
# 16-bit transformers have their own tests, test_transformer_precision.py).
SHRINK = {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "filter_size": 64, "vocab_size": 512,
          "max_position_embeddings": 16}
LM_FILES = {
    "gpt2_small_r18": ("gpt2", "model.", "train_input.", "eval_input.", "runconfig.max_steps",
                       ["model.mixed_precision=false", "train_input.max_sequence_length=16",
                        "eval_input.max_sequence_length=16"]),
    "gpt2_small_trainer": ("gpt2", "trainer.init.model.", "trainer.fit.train_dataloader.",
                           "trainer.fit.val_dataloader.", "trainer.init.loop.max_steps",
                           ["trainer.init.precision.enabled=false"]),
    "bert_base_r18": ("bert", "model.", "train_input.", "eval_input.", "runconfig.max_steps",
                      ["model.mixed_precision=false",
                       "train_input.max_sequence_length=16", "eval_input.max_sequence_length=16",
                       "train_input.max_predictions_per_seq=3", "eval_input.max_predictions_per_seq=3"]),
    "bert_base_trainer": ("bert", "trainer.init.model.", "trainer.fit.train_dataloader.",
                          "trainer.fit.val_dataloader.", "trainer.init.loop.max_steps",
                          ["trainer.init.precision.enabled=false",
                           *(f"trainer.fit.{loader}.{key}" for loader in ("train_dataloader", "val_dataloader")
                             for key in ("max_sequence_length=16", "max_predictions_per_seq=3"))]),
}


def shrunk(name: str, data: str, steps: int) -> tuple[str, list[str]]:
    model, m, train, val, max_steps, extra = LM_FILES[name]
    sets = [f"{m}{k}={v}" for k, v in SHRINK.items()] + extra + [
        f"{train}data_dir={data}/train", f"{val}data_dir={data}/val", f"{train}batch_size=4",
        f"{val}batch_size=4", f"{max_steps}={steps}"]
    return model, [arg for s in sets for arg in ("--override", s)]


@pytest.mark.cluster
@pytest.mark.parametrize("name", sorted(LM_FILES))
def test_language_model_files_train_tied_on_the_cs_system_as_on_the_cpu(tmp_path: Path, name: str) -> None:
    """The model zoo's head (tied to the token embedding; GPT-2's without a bias) on one WSE
    equals the CPU path step by step, and the checkpoint holds the table once: weight
    streaming for the 1.8 files (a wafer memory the model exceeds, csconfig), layer
    pipelined for the trainer file (it fits; a 2.x file has no csconfig)."""
    steps = 6
    model, overrides = shrunk(name, token_data(tmp_path / "tokens", vocab=512), steps)
    trainer = name.endswith("trainer")
    if not trainer:
        overrides += ["--override", "csconfig.wafer_memory_bytes=100000"]
    runs = {}
    for launcher in ("csrun_cpu", "csrun_wse"):
        model_dir = tmp_path / launcher
        result = run_script(model, FILES / f"{name}.yaml", model_dir, *overrides, launcher=launcher)
        assert result.returncode == 0, result.stdout + result.stderr
        if launcher == "csrun_wse":
            mode = "pipelined" if trainer else "weight_streaming"
            assert f"Mode={mode}, Step={steps}," in result.stdout, result.stdout
        with np.load(model_dir / f"checkpoint_{steps}.npz") as ckpt:
            runs[launcher] = (train_losses(model_dir), {k: ckpt[k] for k in ckpt.files if k.startswith("model/")})
    (cpu_losses, cpu_w), (wse_losses, wse_w) = runs["csrun_cpu"], runs["csrun_wse"]
    assert len(cpu_losses) == steps and np.isfinite(cpu_losses).all()
    np.testing.assert_allclose(wse_losses, cpu_losses, rtol=1e-5)
    assert "model/embed/tokens" in cpu_w and not [k for k in cpu_w if k.startswith("model/lm_head/")
                                                  and k.rsplit("/", 1)[1] in ("tokens", "decoder_weight")]
    assert ("model/lm_head/decoder_bias" in cpu_w) == (model == "bert")   # GPT-2: use_bias_in_output false
    # BERT trains its next-sentence head as shipped (disable_nsp false): segment table, pooler, classifier
    nsp = {"model/embed/segments", "model/nsp_head/pooler_weight", "model/nsp_head/classifier_weight"}
    assert (nsp <= cpu_w.keys()) == (model == "bert")
    assert cpu_w.keys() == wse_w.keys()
    for key in cpu_w:
        np.testing.assert_allclose(wse_w[key], cpu_w[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.cluster
def test_fc_mnist_files_train_with_only_data_and_steps_changed(tmp_path: Path) -> None:
    for name in ("fc_mnist_pytorch_r18", "fc_mnist_tf"):
        model_dir = tmp_path / name
        result = run_script("fc_mnist", FILES / f"{name}.yaml", model_dir,
                            "--override", "train_input.data_dir=null", "--override", "eval_input.data_dir=null",
                            "--override", "runconfig.max_steps=6", mode="train_and_eval")
        assert result.returncode == 0, result.stdout + result.stderr
        losses = train_losses(model_dir)
        assert len(losses) == 6 and np.isfinite(losses).all()
        assert "| Eval " in result.stdout
        with np.load(model_dir / "checkpoint_6.npz") as ckpt:
            slots = {key.rsplit("/", 1)[-1] for key in ckpt.files if key.startswith("optimizer/")}
        # FC-MNIST TF trains with Adam when the file names no optimizer; r18 with SGD + momentum.
        assert slots >= ({"exp_avg", "exp_avg_sq"} if name == "fc_mnist_tf" else {"momentum"}), slots


@pytest.mark.cluster
def test_tiny_gpt2_trainer_file_trains_and_saves_the_initial_checkpoint(tmp_path: Path) -> None:
    data = token_data(tmp_path / "tokens", vocab=512)
    model_dir = tmp_path / "model_dir"
    result = run_script("gpt2", FILES / "gpt2_tiny_trainer.yaml", model_dir,
                        "--override", f"trainer.fit.train_dataloader.data_dir={data}/train",
                        "--override", f"trainer.fit.val_dataloader.data_dir={data}/val",
                        "--override", "trainer.init.loop.max_steps=8", mode="train_and_eval")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = train_losses(model_dir)
    assert len(losses) == 8 and np.isfinite(losses).all()
    assert abs(losses[0] - math.log(512)) < 0.1     # an untrained head spreads over vocab_size 512 tokens
    assert (model_dir / "checkpoint_0.npz").exists() and (model_dir / "checkpoint_8.npz").exists()


@pytest.mark.cluster
def test_tiny_bert_file_trains(tmp_path: Path) -> None:
    data = token_data(tmp_path / "tokens", vocab=512)
    model_dir = tmp_path / "model_dir"
    result = run_script("bert", FILES / "bert_tiny_r23.yaml", model_dir,
                        "--override", f"train_input.data_dir={data}/train",
                        "--override", f"eval_input.data_dir={data}/val",
                        "--override", "runconfig.max_steps=4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(train_losses(model_dir)) == 4


def test_vocab_size_and_data_must_agree(tmp_path: Path) -> None:
    with pytest.raises(TextDataError, match="model.vocab_size 50257 does not match the data"):
        load_corpus(None, "train", 50257)
    data = Path(token_data(tmp_path, vocab=512))
    assert load_corpus(str(data / "train"), "train", 512).max() < 512
    with pytest.raises(TextDataError, match=r"token ids outside \[0, 300\)"):
        load_corpus(str(data / "train"), "train", 300)


@pytest.mark.cluster
def test_eval_frequency_below_the_run_is_refused_in_train_and_eval(tmp_path: Path) -> None:
    result = run_script("fc_mnist", FILES / "fc_mnist_pytorch_r20.yaml", tmp_path / "model_dir",
                        "--override", "train_input.data_dir=null", "--override", "eval_input.data_dir=null",
                        "--override", "runconfig.max_steps=4", "--override", "runconfig.eval_frequency=2",
                        mode="train_and_eval")
    assert result.returncode == 2
    assert "runconfig.eval_frequency 2: evaluating during training is not emulated" in result.stderr


# ------------------------------------------------------------------ what the keys do


def test_schedules() -> None:
    def lr(schedule, step):
        return params_from_dict({"optimizer": {"learning_rate": schedule}}).optimizer.lr_at(step)
    cosine = {"scheduler": "CosineDecay", "initial_learning_rate": 1.0, "end_learning_rate": 0.0, "decay_steps": 10}
    assert lr(cosine, 0) == 1.0 and math.isclose(lr(cosine, 5), 0.5) and lr(cosine, 10) == 0.0
    exp = {"scheduler": "Exponential", "initial_learning_rate": 1.0, "decay_rate": 0.5, "decay_steps": 2}
    assert math.isclose(lr(exp, 3), 0.5 ** 1.5) and lr({**exp, "staircase": True}, 3) == 0.5
    pieces = [{"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1.0, "steps": 4},
              {"scheduler": "Constant", "learning_rate": 0.25, "total_iters": 2},
              {"scheduler": "Exponential", "initial_learning_rate": 0.2, "decay_rate": 0.1, "decay_steps": 1}]
    assert [lr(pieces, s) for s in (0, 2, 4, 5)] == [0.0, 0.5, 0.25, 0.25]
    assert math.isclose(lr(pieces, 7), 0.2 * 0.1)
    assert "every schedule but the last needs steps" in error_lines(
        {"optimizer": {"learning_rate": [{**cosine, "decay_steps": None}, cosine]}})[0]


def test_run_length_keys() -> None:
    def rc(**keys):
        return params_from_dict({"runconfig": keys}).runconfig
    assert rc(num_steps=5).stop_step(10) == 15 and rc(max_steps=5).stop_step(3) == 5
    assert rc(num_epochs=2, steps_per_epoch=7).stop_step(0) == 14 and rc(num_epochs=3).stop_step(0, 4) == 12
    # Several: the run stops at the first reached (the real compute_num_steps takes the smallest).
    assert rc(max_steps=5, num_steps=3).stop_step(1) == 4 and rc(max_steps=5, num_steps=9).stop_step(1) == 5
    assert rc(num_epochs=1, steps_per_epoch=1000, max_steps=10000).stop_step(0) == 1000   # R1.9 FC-MNIST
    assert rc(num_epochs=2, max_steps=5).stop_step(0, 4) == 5
    assert error_lines({"runconfig": {"num_epochs": 5, "num_steps": 5}}) == [
        "params.yaml: runconfig: give num_steps or num_epochs, not both (max_steps may go with either)"]


def test_no_weight_decay_of_biases_and_norm_gains() -> None:
    params = {"weight": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32),
              "ln_gain": np.ones(2, np.float32)}
    zero = {k: np.zeros_like(v) for k, v in params.items()}
    for exclude in (True, False):
        opt = Optimizer(OptimizerSpec("adamw", weight_decay=0.5, exclude_bias_and_norm=exclude))
        w = {k: v.copy() for k, v in params.items()}
        opt.update(w, zero, opt.init_state(w), 0.1)
        assert np.allclose(w["weight"], 0.95)
        assert np.allclose(w["bias"], 1.0 if exclude else 0.95) and np.allclose(w["ln_gain"], w["bias"])


def test_norm_weights_of_captured_torch_models_are_not_decayed_either() -> None:
    opt = Optimizer(OptimizerSpec("adamw", weight_decay=0.1, exclude_bias_and_norm=True))
    spared = ["blocks.0.ln_1.weight", "ln_f.weight", "norm.weight", "bn1.weight", "layernorm.weight", "ln1_gain",
              "h.0.attn.c_attn.bias"]
    decayed = ["weight", "h.0.attn.c_attn.weight", "tokens", "decoder_weight", "fc_weight", "lnx"]
    assert [opt.decay_of(n) for n in spared] == [0.0] * len(spared)
    assert [opt.decay_of(n) for n in decayed] == [0.1] * len(decayed)


def test_max_predictions_per_seq_caps_the_masked_tokens() -> None:
    tokens = load_corpus(None, "train")
    capped = BertDataset(tokens, 64, 0.3, seed=1, max_predictions=3).get(np.arange(16))[1]
    free = BertDataset(tokens, 64, 0.3, seed=1).get(np.arange(16))[1]
    assert ((capped >= 0).sum(axis=1) <= 3).all() and ((free >= 0).sum(axis=1) > 3).any()
    assert np.isin(np.flatnonzero(capped >= 0), np.flatnonzero(free >= 0)).all()   # a subset, same labels


def test_num_workers_fetch_ahead_gives_the_same_batches() -> None:
    data = (np.arange(200, dtype=np.float32).reshape(100, 2), np.arange(100))
    p = params_from_dict({"train_input": {"batch_size": 8, "num_workers": 3, "prefetch_factor": 2}})
    stream = InputStream.build("train", data, p.train_input, 1)
    ahead = [(s, get()) for s, get in fetched_ahead(stream, range(12), 2, p.train_input)]
    inline = [(s, get()) for s, get in fetched_ahead(stream, range(12), 2, params_from_dict({}).train_input)]
    assert [s for s, _ in ahead] == list(range(12))
    for (_, a), (_, b) in zip(ahead, inline):
        for sa, sb in zip(a, b):
            np.testing.assert_array_equal(sa.x, sb.x)
            np.testing.assert_array_equal(sa.y, sb.y)


def test_override_paths_and_values(tmp_path: Path) -> None:
    p = load_params(FILES / "fc_mnist_tf.yaml", "fc_mnist",
                    ["runconfig.max_steps=7", "optimizer.learning_rate=1e-2", "eval_input.batch_size=10"])
    assert p.runconfig.max_steps == 7 and p.optimizer.lr_at(0) == 0.01 and p.eval_input.batch_size == 10
    with pytest.raises(ParamsError, match="--override runconfig: expected KEY.PATH=VALUE"):
        load_params(FILES / "fc_mnist_tf.yaml", "fc_mnist", ["runconfig"])


@pytest.mark.cluster
def test_fc_mnist_tf_file_on_the_cs_system_matches_the_cpu_oracle(tmp_path: Path) -> None:
    """Adam (the TF default), weight decay sparing the biases, 2 fetch threads per
    input worker: the CS system's losses and weights are the CPU path's."""
    overrides = ("--override", "train_input.data_dir=null", "--override", "runconfig.max_steps=12",
                 "--override", "runconfig.save_summary_steps=1", "--override", "optimizer.weight_decay=0.05",
                 "--override", "train_input.num_workers=2", "--override", "train_input.batch_size=64")
    runs = {}
    for launcher in ("csrun_cpu", "csrun_wse"):
        model_dir = tmp_path / launcher
        result = run_script("fc_mnist", FILES / "fc_mnist_tf.yaml", model_dir, *overrides, launcher=launcher)
        assert result.returncode == 0, result.stdout + result.stderr
        with np.load(model_dir / "checkpoint_12.npz") as ckpt:
            runs[launcher] = (train_losses(model_dir), {k: ckpt[k] for k in ckpt.files if k.startswith("model/")})
    (cpu_losses, cpu_w), (wse_losses, wse_w) = runs["csrun_cpu"], runs["csrun_wse"]
    assert len(cpu_losses) == 12
    np.testing.assert_allclose(wse_losses, cpu_losses, rtol=1e-5)
    for name in cpu_w:
        np.testing.assert_allclose(wse_w[name], cpu_w[name], rtol=1e-5, atol=1e-7)


@pytest.mark.cluster
def test_fc_mnist_r20_trains_on_mnist_in_torchvisions_layout(tmp_path: Path) -> None:
    """The model zoo's FC-MNIST downloads MNIST with torchvision: data_dir/MNIST/raw/."""
    from tests.test_data import write_split
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images, _ = write_split(raw, "train", 64, gz=True)
    write_split(raw, "t10k", 16)
    model_dir = tmp_path / "model_dir"
    result = run_script("fc_mnist", FILES / "fc_mnist_pytorch_r20.yaml", model_dir,
                        "--override", f"train_input.data_dir={tmp_path / 'mnist'}",
                        "--override", f"eval_input.data_dir={tmp_path / 'mnist'}",
                        "--override", "runconfig.max_steps=5", mode="train_and_eval")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(train_losses(model_dir)) == 5
    assert "Accuracy=" in result.stdout and "(" in result.stdout.split("Accuracy=")[1]
    assert re.search(r"Accuracy=[\d.]+ \(\d+/16\)", result.stdout), result.stdout   # the 16 t10k samples


@pytest.mark.parametrize("name, model", SHIPPED + [("gpt2_tiny_trainer", "gpt2"), ("bert_tiny_r23", "bert")])
def test_to_dict_round_trips(name: str, model: str) -> None:
    """What checkpoints and TensorBoard record (to_dict) reads back as the same params."""
    p = load_params(FILES / f"{name}.yaml", model)
    assert params_from_dict(p.to_dict(), model=model) == p
    assert params_from_dict(p.to_dict()).model == p.model       # no script: the section says which model


def test_mlm_loss_weight_scales_bert_loss_as_the_model_zoo() -> None:
    """mlm_loss_weight * (sum of the masked tokens' cross-entropy) / batch_size, by hand."""
    from examples.bert.run import model_fn
    from tests.dense_reference import model_loss   # the loss of the spec, by the formula
    model = {"name": "bert", "vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2,
             "filter_size": 16, "max_position_embeddings": 6, "dropout_rate": 0.0, "attention_dropout_rate": 0.0,
             "layer_norm_epsilon": 1e-5, "disable_nsp": True, "mlm_loss_weight": 0.25}
    spec = model_fn(params_from_dict({"model": model}, model="bert"))
    assert spec.loss_weight == 0.25 and spec.loss_scaling == "batch_size"
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 6, 11)).astype(np.float32)
    labels = np.full((3, 6), -100, dtype=np.int64)
    labels[0, 1], labels[1, 4], labels[1, 5], labels[2, 0] = 3, 7, 0, 10
    result = model_loss(spec, logits, labels, global_batch=3, label_count=4)
    hand, grad = 0.0, np.zeros_like(logits, dtype=np.float64)
    for (b, t) in zip(*np.nonzero(labels != -100)):
        z = logits[b, t].astype(np.float64)
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        hand += -np.log(p[labels[b, t]])
        grad[b, t] = p
        grad[b, t, labels[b, t]] -= 1.0
    assert result.loss == pytest.approx(0.25 * hand / 3, rel=1e-6)
    np.testing.assert_allclose(result.delta, 0.25 * grad / 3, rtol=1e-5, atol=1e-7)
    unweighted = model_fn(params_from_dict({"model": {**model, "mlm_loss_weight": None}}, model="bert"))
    assert model_loss(unweighted, logits, labels, 3, 4).loss == pytest.approx(hand / 3, rel=1e-6)


BERT_MODEL = {"name": "bert", "vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2,
              "filter_size": 16, "max_position_embeddings": 6, "dropout_rate": 0.0, "attention_dropout_rate": 0.0,
              "layer_norm_epsilon": 1e-5, "disable_nsp": True}


def test_mlm_loss_scaling_num_masked_is_the_mean_over_the_masked_tokens() -> None:
    from examples.bert.run import model_fn
    from tests.dense_reference import model_loss   # the loss of the spec, by the formula
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 6, 11)).astype(np.float32)
    labels = np.full((3, 6), -100, dtype=np.int64)
    labels[0, 1], labels[1, 4], labels[2, 0] = 3, 7, 10
    z = logits[labels != -100].astype(np.float64)
    picked = z[np.arange(3), labels[labels != -100]]
    mean = float((np.log(np.exp(z).sum(axis=1)) - picked).mean())
    for scaling in ("num_masked", "Precomputed_Num_Masked"):
        spec = model_fn(params_from_dict({"model": {**BERT_MODEL, "mlm_loss_scaling": scaling}}, model="bert"))
        assert spec.loss_scaling == scaling.lower()
        assert model_loss(spec, logits, labels, global_batch=3, label_count=3).loss == pytest.approx(mean, rel=1e-6)
    assert model_fn(params_from_dict({"model": BERT_MODEL}, model="bert")).loss_scaling == "batch_size"
    assert any("model.mlm_loss_scaling" in line for line in error_lines(
        {"model": {**BERT_MODEL, "mlm_loss_scaling": "num_tokens"}}, "bert"))
    with pytest.raises(ParamsError) as info:
        model_fn(params_from_dict({"model": {**BERT_MODEL, "mlm_loss_scaling": "num_masked",
                                             "mlm_loss_weight": 0.5}}, model="bert"))
    assert [line.split(":")[0] for line in lines_of(info)] == ["model.mlm_loss_weight"]


def test_the_heads_are_the_model_zoos_unless_the_file_says_otherwise() -> None:
    """share_embedding_weights defaults to true (both models), use_bias_in_output to false
    (GPT-2); BERT's decoder bias is use_output_bias_in_mlm's (default true)."""
    from examples.bert.run import model_fn as bert_fn
    from examples.gpt2.run import model_fn as gpt2_fn
    gpt2 = {key: value for key, value in BERT_MODEL.items() if key != "disable_nsp"} | {"name": "gpt2"}
    head = lambda fn, model, kind: fn(params_from_dict({"model": model}, model=kind)).layers[-1]  # noqa: E731
    assert (head(gpt2_fn, gpt2, "gpt2").tied, head(gpt2_fn, gpt2, "gpt2").out_bias) == ("embed", False)
    custom = head(gpt2_fn, {**gpt2, "share_embedding_weights": False, "use_bias_in_output": True}, "gpt2")
    assert (custom.tied, custom.out_bias) == ("", True) and "decoder_weight" in custom.param_shapes()
    bert = head(bert_fn, BERT_MODEL, "bert")
    assert (bert.tied, bert.out_bias) == ("embed", True)
    assert not head(bert_fn, {**BERT_MODEL, "share_embedding_weights": False}, "bert").tied
    assert "decoder_bias" not in head(bert_fn, {**BERT_MODEL, "use_output_bias_in_mlm": False},
                                      "bert").param_shapes()
    with pytest.raises(ParamsError) as info:
        bert_fn(params_from_dict({"model": {**BERT_MODEL, "use_bias_in_output": True}}, model="bert"))
    assert [line.split(":")[0] for line in lines_of(info)] == ["model.use_bias_in_output"]


@pytest.mark.cluster
def test_a_tied_model_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path: Path) -> None:
    """The checkpoint holds the table once; a resumed run gives the head its copy back (and the
    copy's Adam slots) and goes on exactly as the run that never stopped."""
    data = token_data(tmp_path / "tokens", vocab=512)
    _, overrides = shrunk("gpt2_small_r18", data, 6)
    overrides += ["--override", "runconfig.checkpoint_steps=3"]
    straight = run_script("gpt2", FILES / "gpt2_small_r18.yaml", tmp_path / "straight", *overrides)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    resumed = run_script("gpt2", FILES / "gpt2_small_r18.yaml", tmp_path / "resumed", *overrides,
                         "--checkpoint_path", str(tmp_path / "straight" / "checkpoint_3.npz"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    with np.load(tmp_path / "straight" / "checkpoint_6.npz") as a, np.load(tmp_path / "resumed" / "checkpoint_6.npz") as b:
        assert "optimizer/embed/tokens/exp_avg" in a.files and "optimizer/lm_head/tokens/exp_avg" not in a.files
        assert set(a.files) == set(b.files)
        for key in a.files:
            if key.startswith(("model/", "optimizer/")):
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
