"""GPT-2 and BERT: text data, the compiler, and every execution mode against the CPU oracle.

    python -m pytest tests/test_transformer.py -q

The whole-job tests run examples/gpt2 and examples/bert with tiny sizes for
20 steps: weight streaming on 2 WSEs (chosen by the compiler because the
model exceeds a small wafer memory) and layer pipelined (chosen because it
fits), each within 1e-5 relative of the CPU run, step by step.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace
import sys

import numpy as np
import pytest
import yaml

from cs_runtime.data import text
from cs_runtime.compiler.costs import program_kernels
from cs_runtime.compiler.errors import CompileError
from cs_runtime.numerics.kernels import IGNORE_INDEX
from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics.model import init_weights, transformer_spec
from cs_runtime.numerics.program_layer import unit_of
from tests.cluster_utils import REPO, TOL, final_weights, relative_error, tool, train_losses

STEPS = 20
LM_PARAMS = {
    "train_input": {"batch_size": 8, "max_sequence_length": 16, "shuffle": True},
    "eval_input": {"batch_size": 8, "max_sequence_length": 16},
    "model": {"hidden_size": 16, "num_hidden_layers": 2, "num_heads": 2, "filter_size": 32,
              "max_position_embeddings": 16, "dropout_rate": 0.1, "attention_dropout_rate": 0.1},
    # SGD, not Adam: the key bias has an exactly zero gradient (softmax ignores
    # a shift shared by all keys), so its float gradient is summation-order
    # noise, which Adam would normalise up to full-size, diverging updates.
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.3, "momentum": 0.9, "max_gradient_norm": 1.0},
    "runconfig": {"max_steps": STEPS, "log_steps": 5, "checkpoint_steps": 0, "seed": 4, "eval_steps": 2},
}
SMALL_WAFER = 100_000  # bytes: the tiny models need ~500 kB with AdamW state


def write_lm_params(path, style: str, **sections) -> str:
    params = {k: dict(v) for k, v in LM_PARAMS.items()}
    params["model"]["model_type"] = style
    if style == "bert":
        params["model"]["disable_nsp"] = True   # masked LM only: the model zoo would add a next-sentence head
    for section, values in sections.items():
        params.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(params))
    return str(path)


def example(style: str) -> str:
    return str(REPO / "examples" / style / "run.py")


def run_job(launcher: list[str], style: str, params: str, model_dir, *extra: str, timeout: int = 300):
    cmd = [*launcher, sys.executable, example(style), "--mode", "train_and_eval", "--params", params,
           "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def eval_loss(stdout: str) -> float:
    found = re.search(r"\| Eval Device=.*Loss=([\d.]+)", stdout)
    assert found, stdout
    return float(found.group(1))


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def lm_oracle(request, tmp_path_factory):
    style = request.param
    tmp = tmp_path_factory.mktemp(f"{style}_oracle")
    params = write_lm_params(tmp / "params.yaml", style)
    result = run_job([tool("csrun_cpu")], style, params, tmp / "cpu")
    return style, tmp / "cpu", train_losses(tmp / "cpu"), final_weights(tmp / "cpu"), eval_loss(result.stdout)


def assert_matches(model_dir, oracle, stdout: str) -> None:
    _, _, losses, weights, oracle_eval = oracle
    got = train_losses(model_dir)
    assert len(got) == len(losses) == STEPS
    worst = (np.abs(got - losses) / np.abs(losses)).max()
    assert worst < TOL, f"loss differs by {worst:.2e} relative"
    got_w = final_weights(model_dir)
    assert got_w.keys() == weights.keys() and len(weights) > 20  # every tensor of every block
    for name in weights:
        assert relative_error(got_w[name], weights[name]) < TOL, name
    assert abs(eval_loss(stdout) - oracle_eval) <= 1e-5 * oracle_eval + 1e-5


# ---------------------------------------------------------------- whole jobs

@pytest.mark.cluster
def test_oracle_learns(lm_oracle):
    style, _, losses, _, final_eval = lm_oracle
    # eval is the mean loss per predicted token whatever the training loss's
    # normaliser: ln(260) = 5.56 untrained
    assert final_eval < np.log(260) - 1.0
    if style == "gpt2":   # its training loss is per token too (num_tokens); BERT's is per sample
        assert losses[0] > 5.0 and losses[-5:].mean() < losses[0] - 0.5


@pytest.mark.cluster
def test_weight_streaming_chosen_for_a_model_over_wafer_memory_equals_oracle(tmp_path, lm_oracle):
    style = lm_oracle[0]
    params = write_lm_params(tmp_path / "ws.yaml", style, csconfig={"wafer_memory_bytes": SMALL_WAFER})
    launcher = [tool("csrun_wse"), "--num_csx", "2", "--num_workers_per_csx", "1"]
    result = run_job(launcher, style, params, tmp_path / "ws")
    assert re.search(r"compile: .*weight_streaming on 2 CS system\(s\) \(the model .* does not fit in 100 KB",
                     result.stdout), \
        result.stdout
    assert f"Mode=weight_streaming, Step={STEPS}," in result.stdout
    streamed = int(re.search(r"WeightBytes/step=(\d+)", result.stdout).group(1))
    params_bytes = sum(w.nbytes for w in lm_oracle[3].values())
    # every tensor forward, and backward again but the last group's (it goes once: fwd_bwd)
    assert params_bytes < streamed < 2 * params_bytes, (streamed, params_bytes)
    assert_matches(tmp_path / "ws", lm_oracle, result.stdout)


@pytest.mark.cluster
def test_pipelined_chosen_when_it_fits_equals_oracle(tmp_path, lm_oracle):
    style = lm_oracle[0]
    params = write_lm_params(tmp_path / "pipe.yaml", style)
    result = run_job([tool("csrun_wse")], style, params, tmp_path / "pipe", "--multireplica")
    assert "pipelined x2 on 1 CS system(s) (the whole model" in result.stdout   # the compile says the mode run
    assert f"Mode=pipelined x2, Step={STEPS}," in result.stdout
    assert "WeightBytes/step=0" in result.stdout
    assert_matches(tmp_path / "pipe", lm_oracle, result.stdout)


@pytest.mark.cluster
def test_gpt_samples_text_from_its_checkpoint(lm_oracle):
    style, model_dir = lm_oracle[0], lm_oracle[1]
    cmd = [sys.executable, str(REPO / "examples" / "gpt2" / "sample.py"), "--model_dir", str(model_dir),
           "--prompt", "The if statement", "--tokens", "40", "--seed", "2"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if style == "bert":
        assert first.returncode == 1 and "not a GPT" in first.stderr
        return
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("The if statement") and len(first.stdout) > len("The if statement")
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout == first.stdout


# ---------------------------------------------------------------- text data

def test_byte_tokenizer_round_trips_any_text():
    sample = "def f(x):\n    return x  # ünïcödé ✓"
    ids = text.encode(sample)
    assert ids.min() >= text.OFFSET and ids.max() < text.VOCAB_SIZE
    assert text.decode(ids) == sample
    assert text.decode([text.CLS, *ids, text.PAD]) == sample


def test_builtin_corpus_is_python_reference_text_split_train_eval():
    train, evaluation = text.load_corpus(None, "train"), text.load_corpus(None, "eval")
    assert len(train) > 300_000 and len(evaluation) > 10_000
    assert abs(len(evaluation) / (len(train) + len(evaluation)) - text.EVAL_FRACTION) < 1e-3
    assert "statement" in text.decode(train[:5000])


def test_gpt_samples_are_shifted_windows():
    tokens = np.arange(4, 104, dtype=np.int32)
    ds = text.GptDataset(tokens, 10)
    assert len(ds) == 9
    x, y = ds.get(np.array([2, 0]))
    assert np.array_equal(x[0], tokens[20:30]) and np.array_equal(y[0], tokens[21:31])
    with pytest.raises(text.TextDataError, match="shorter than one sequence"):
        text.GptDataset(tokens[:5], 10)


def test_bert_samples_pack_lines_pad_and_mask_deterministically():
    tokens = text.load_corpus(None, "train")[:20000]
    ds = text.BertDataset(tokens, 32, 0.15, seed=1)
    x, y = ds.get(np.arange(len(ds)))
    assert (x[:, 0] == text.CLS).all()
    assert (x == text.PAD).any()  # short lines leave padding
    labelled = y != IGNORE_INDEX
    assert labelled.any(axis=1).all()  # every sample has something to predict
    share = labelled.sum() / (x >= text.OFFSET).sum()
    assert 0.12 < share < 0.22
    assert 0.7 < (x[labelled] == text.MASK).mean() < 0.9
    assert (y[labelled] >= text.OFFSET).all() and not (x[labelled] == text.PAD).any()
    x2, y2 = ds.get(np.array([7, 3]))
    assert np.array_equal(x2, x[[7, 3]]) and np.array_equal(y2, y[[7, 3]])
    x3, _ = text.BertDataset(tokens, 32, 0.15, seed=2).get(np.arange(len(ds)))
    assert not np.array_equal(x3, x)


def test_data_dir_reads_text_or_npy_shards_and_rejects_bad_ones(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    whole = np.concatenate([text.load_corpus(str(tmp_path), "train"), text.load_corpus(str(tmp_path), "eval")])
    assert text.decode(whole) == "first\n\n\nsecond\n"
    shards = tmp_path / "npy"
    shards.mkdir()
    np.save(shards / "0.npy", text.encode("hello world, " * 10))
    assert text.decode(text.load_corpus(str(shards), "train")).startswith("hello world")
    np.save(shards / "1.npy", np.array([1000]))
    with pytest.raises(text.TextDataError, match=r"1\.npy: token ids outside"):
        text.load_corpus(str(shards), "train")
    with pytest.raises(text.TextDataError, match="no such folder"):
        text.load_corpus(str(tmp_path / "missing"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(text.TextDataError, match=r"no \*\.npy or \*\.txt"):
        text.load_corpus(str(tmp_path / "empty"), "train")


# ---------------------------------------------------------------- compiler

@pytest.mark.parametrize("style,tied,out_bias", [("gpt2", False, True), ("bert", False, True),
                                                ("gpt2", True, False), ("bert", True, True)])
def test_the_plan_reads_the_program_the_executors_run(style, tied, out_bias):
    spec = transformer_spec(style, style=style, vocab_size=text.VOCAB_SIZE, max_len=8, hidden_size=8,
                            num_layers=2, num_heads=2, ffn_features=16, dropout=0.1, attn_dropout=0.1, eps=1e-5,
                            pad_id=text.PAD if style == "bert" else -1, tied=tied, out_bias=out_bias)
    program = lower_spec(spec)   # what the executors run
    kernels = program_kernels(program, train=True, copies=2)
    # Every forward op of every unit is in exactly one kernel, in order: nothing planned that
    # does not run, nothing run that is not planned.
    ran = [n.op for layer in program.layers for n in unit_of(layer).forward]
    assert [op for k in kernels for op in k.nodes] == ran
    assert {"embedding", "layer_norm", "self_attention", "matmul", "add"} <= set(ran)
    assert any(k.name == "block0.fc" for k in kernels)
    # Its weights are the model's: every parameter the units stream, counted per unit that reads it.
    streamed = sum(int(np.prod(shape)) for layer in program.layers for shape in layer.param_shapes().values())
    assert sum(k.cost.weight_bytes for k in kernels) == 4 * streamed


def test_compiler_names_a_bad_transformer_layer():
    spec = transformer_spec("g", style="gpt2", vocab_size=10, max_len=4, hidden_size=8, num_layers=1, num_heads=2,
                            ffn_features=8, dropout=0.0, attn_dropout=0.0, eps=1e-5)
    bad = replace(spec, layers=(spec.layers[0], replace(spec.layers[1], num_heads=3), spec.layers[2]))
    with pytest.raises(CompileError, match=r"layer block0 \(op transformer_block\): .*num_heads"):
        lower_spec(bad)


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_examples_name_a_bad_params_key(style):
    from importlib import import_module

    from cs_runtime.config import params_from_dict
    model_fn = import_module(f"examples.{style}.run").model_fn
    nsp = {"disable_nsp": True} if style == "bert" else {}
    too_long = params_from_dict({"model": {"model_type": style, "max_position_embeddings": 16, **nsp},
                                 "eval_input": {"max_sequence_length": 32}})
    with pytest.raises(ValueError, match="eval_input.max_sequence_length 32 exceeds model.max_position_embeddings 16"):
        model_fn(too_long)
    other = "bert" if style == "gpt2" else "gpt2"
    with pytest.raises(ValueError, match=f"this script builds {style}"):
        model_fn(params_from_dict({"model": {"model_type": other}}))
    with pytest.raises(ValueError, match=f"model.model_type: '{other}', but this script builds {style}"):
        params_from_dict({"model": {"model_type": other}}, model=style)
    spec = model_fn(params_from_dict({"model": {"model_type": style, **nsp}}))
    assert [l.op for l in spec.layers] == ["embedding", "transformer_block", "transformer_block", "lm_head"]
    assert spec.layers[1].causal == (style == "gpt2")


def test_gpt2_init_scales_residual_projections_by_depth_and_bert_does_not():
    shape = dict(vocab_size=50, max_len=8, hidden_size=64, num_heads=2, ffn_features=256,
                 dropout=0.0, attn_dropout=0.0, eps=1e-5)
    for layers in (2, 8):
        gpt = init_weights(transformer_spec("g", style="gpt2", num_layers=layers, **shape), 0)
        bert = init_weights(transformer_spec("b", style="bert", num_layers=layers, **shape), 0)
        for name in ("proj_weight", "out_weight"):
            want = 0.02 / np.sqrt(2 * layers)
            assert abs(gpt["block0"][name].std() / want - 1) < 0.05, (layers, name)
            assert abs(bert["block0"][name].std() / 0.02 - 1) < 0.05, (layers, name)
        assert abs(gpt["block0"]["qkv_weight"].std() / 0.02 - 1) < 0.05   # the others keep 0.02
