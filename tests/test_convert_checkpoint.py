"""cs_convert_checkpoint and the formats behind it: this project's .npz, the model
zoo's HDF5 .mdl (h5py), a PyTorch state_dict (torch); round trips exact, torch's
(out, in) layout checked against a torch module, --checkpoint_path reads an .mdl.

    python -m pytest tests/test_convert_checkpoint.py -q
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cs_runtime import checkpoint as ckpt
from cs_runtime import torch_names
from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec, model_forward, transformer_spec
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from cs_runtime.cli import convert_checkpoint as convert

try:   # imported here, at collection: h5py's import runs `uname -p`, which a test may not start
    import h5py
except ImportError:
    h5py = None
NEEDS_H5PY = "the .mdl layout is HDF5: needs h5py (pip install 'cs-emulator[hdf5]')"
NEEDS_TORCH = "a PyTorch state_dict needs torch (pip install 'cs-emulator[torch]')"


def specs():
    small = dict(vocab_size=30, max_len=8, hidden_size=12, num_layers=2, num_heads=3, ffn_features=20,
                 dropout=0.0, attn_dropout=0.0, eps=1e-5)
    return {"fc_mnist": mlp_spec("fc", [6, 5, 4, 3], "relu", 0.0),
            "gpt2": transformer_spec("gpt2", style="gpt2", **small),
            "bert": transformer_spec("bert", style="bert", **small),
            # the model zoo's heads: tied to the token embedding, GPT-2's without a bias
            "gpt2_tied": transformer_spec("gpt2", style="gpt2", tied=True, out_bias=False, **small),
            "bert_tied": transformer_spec("bert", style="bert", tied=True, **small)}


def trained_checkpoint(spec, kind: str = "adam", step: int = 7) -> ckpt.Checkpoint:
    """Weights and optimizer state that are not their initial values (every slot differs)."""
    weights = init_weights(spec, seed=3)
    optimizer = Optimizer(OptimizerSpec(kind, momentum=0.9))
    rng = np.random.default_rng(5)
    state = {}
    for layer, params in weights.items():
        for p in params:
            params[p] = params[p] + rng.standard_normal(params[p].shape).astype(np.float32)
        state[layer] = optimizer.init_state(params)
        for slots in state[layer].values():
            for name, value in slots.items():
                slots[name] = (np.float32(step) if name == "step"
                               else rng.random(value.shape).astype(np.float32)) + np.zeros_like(value)
    meta = {"model": spec.describe(), "params": {"optimizer": {"optimizer_type": kind}}}
    return ckpt.Checkpoint(step, step, *ckpt.stored_once(spec, weights, state), meta)   # as the trainer saves


def assert_same_state(a: ckpt.Checkpoint, b: ckpt.Checkpoint, opt: bool = True) -> None:
    assert a.global_step == b.global_step
    assert a.weights.keys() == b.weights.keys()
    for layer, params in a.weights.items():
        assert params.keys() == b.weights[layer].keys(), layer
        for p, w in params.items():
            np.testing.assert_array_equal(w, b.weights[layer][p])
            assert b.weights[layer][p].dtype == np.float32
            if opt:
                assert a.opt_state[layer][p].keys() == b.opt_state[layer][p].keys()
                for slot, v in a.opt_state[layer][p].items():
                    np.testing.assert_array_equal(v, b.opt_state[layer][p][slot])


def write_npz(tmp_path: Path, state: ckpt.Checkpoint) -> Path:
    return ckpt.save(tmp_path / "model_dir", state)


# ---------------------------------------------------------------- names (no torch, no h5py)

@pytest.mark.parametrize("family", ["fc_mnist", "gpt2", "bert", "gpt2_tied", "bert_tied"])
def test_torch_names_round_trip_and_layout(family: str) -> None:
    spec = specs()[family]
    weights = ckpt.stored_once(spec, init_weights(spec, seed=1), {})[0]
    table, aliases = torch_names.table_for(spec.describe())
    named = torch_names.to_torch(table, aliases, weights)
    back = torch_names.from_torch(table, aliases, named, "test")
    for layer, params in weights.items():
        for p, w in params.items():
            np.testing.assert_array_equal(back[layer][p], w)
    # the family is found from the names alone too (a model-zoo file without our description)
    assert torch_names.family_from_names(named) == torch_names.family_of(spec.describe())
    assert torch_names.family_from_weights(weights) == torch_names.family_of(spec.describe())


def test_torch_names_are_the_model_zoos() -> None:
    s = specs()
    mlp = torch_names.to_torch(*torch_names.table_for(s["fc_mnist"].describe()), init_weights(s["fc_mnist"], 0))
    assert sorted(mlp) == ["fc_layers.0.bias", "fc_layers.0.weight", "fc_layers.1.bias", "fc_layers.1.weight",
                           "last_layer.bias", "last_layer.weight"]
    assert mlp["fc_layers.0.weight"].shape == (5, 6)      # torch's (out, in)
    gw = init_weights(s["gpt2"], 0)
    gpt = torch_names.to_torch(*torch_names.table_for(s["gpt2"].describe()), gw)
    q = gpt["transformer_decoder.layers.1.self_attn.proj_q_dense_layer.weight"]
    v = gpt["transformer_decoder.layers.1.self_attn.proj_v_dense_layer.bias"]
    np.testing.assert_array_equal(q, gw["block1"]["qkv_weight"][:, :12].T)
    np.testing.assert_array_equal(v, gw["block1"]["qkv_bias"][24:])
    np.testing.assert_array_equal(gpt["ln_f.weight"], gpt["transformer_decoder.norm.weight"])
    assert gpt["lm_head.weight"].shape == (30, 12)
    bert = torch_names.to_torch(*torch_names.table_for(s["bert"].describe()), init_weights(s["bert"], 0))
    assert "bert_encoder.embed_ln_f.weight" in bert
    assert bert["bert_mlm_head.classifier.ffn.0.linear_layer.weight"].shape == (30, 12)
    assert "bert_encoder.transformer_encoder.layers.0.norm2.bias" in bert


@pytest.mark.parametrize("family", ["gpt2_tied", "bert_tied"])
def test_a_tied_heads_decoder_is_the_word_embeddings_under_its_torch_name(family: str) -> None:
    """The model zoo's tied module writes the one tensor under both names; a file whose two
    differ is an untied model, read as one (its decoder matrix, transposed)."""
    spec = specs()[family]
    weights = ckpt.stored_once(spec, init_weights(spec, 2), {})[0]
    assert "tokens" not in weights["lm_head"] and "decoder_weight" not in weights["lm_head"]
    named = torch_names.to_torch(*torch_names.table_for(spec.describe()), weights)
    decoder, embedding = torch_names.DECODERS[family.split("_")[0]]
    assert named[f"{decoder}.weight"] is named[embedding]
    assert (f"{decoder}.bias" in named) == (family == "bert_tied")   # GPT-2's use_bias_in_output: false
    back = torch_names.from_torch(*torch_names.table_for(None, named), named, "tied")
    assert back["lm_head"].keys() == weights["lm_head"].keys()
    named[f"{decoder}.weight"] = named[embedding] + 1.0
    untied = torch_names.from_torch(*torch_names.table_for(None, named), named, "untied")
    np.testing.assert_array_equal(untied["lm_head"]["decoder_weight"], named[f"{decoder}.weight"].T)


def test_a_captured_programs_weights_keep_their_torch_names() -> None:
    model = {"name": "mlp", "units": [{"name": "u0", "params": {"layers.0.weight": [3, 4], "layers.0.bias": [3]}},
                                      {"name": "u1", "params": {"layers.1.weight": [2, 3]}}]}
    rng = np.random.default_rng(0)
    weights = {"u0": {"layers.0.weight": rng.random((3, 4)), "layers.0.bias": rng.random(3)},
               "u1": {"layers.1.weight": rng.random((2, 3))}}
    table, aliases = torch_names.table_for(model)
    named = torch_names.to_torch(table, aliases, weights)
    assert sorted(named) == ["layers.0.bias", "layers.0.weight", "layers.1.weight"]
    np.testing.assert_array_equal(named["layers.1.weight"], weights["u1"]["layers.1.weight"])   # torch's layout
    back = torch_names.from_torch(table, aliases, named, "test")
    np.testing.assert_array_equal(back["u0"]["layers.0.weight"], weights["u0"]["layers.0.weight"])


def test_unknown_torch_names_are_one_line() -> None:
    spec = specs()["bert"]
    table, aliases = torch_names.table_for(spec.describe())
    named = torch_names.to_torch(table, aliases, init_weights(spec, 0))
    named["bert_encoder.embedding_layer.segment_embeddings.weight"] = np.zeros((2, 12), np.float32)
    del named["bert_encoder.embed_ln_f.bias"]
    with pytest.raises(torch_names.NameMapError) as err:
        torch_names.from_torch(table, aliases, named, "checkpoint x.mdl")
    message = str(err.value)
    assert "\n" not in message and "segment_embeddings" in message and "missing bert_encoder.embed_ln_f.bias" in message


# ---------------------------------------------------------------- .mdl (h5py)

@pytest.mark.parametrize("family,kind", [("fc_mnist", "sgd"), ("gpt2", "adam"), ("bert", "adamw"),
                                         ("gpt2_tied", "adamw"), ("bert_tied", "adam")])
def test_mdl_round_trip_is_exact(tmp_path: Path, family: str, kind: str) -> None:
    if h5py is None:
        pytest.skip(NEEDS_H5PY)
    state = trained_checkpoint(specs()[family], kind)
    source = write_npz(tmp_path, state)
    convert.main([str(source), str(tmp_path / "model.mdl")])
    with h5py.File(tmp_path / "model.mdl", "r") as f:
        assert int(f["global_step"][()]) == 7
        names = set(f.keys())
    assert all(n.startswith(("model.", "optimizer.state.")) or n == "global_step" for n in names)
    if kind == "sgd":
        assert "optimizer.state.0.momentum_buffer" in names and "model.last_layer.weight" in names
    else:
        assert {"optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"} <= names
    convert.main([str(tmp_path / "model.mdl"), str(tmp_path / "back.npz")])
    back = ckpt.load(tmp_path / "back.npz")
    assert_same_state(state, back)
    assert back.meta == state.meta


def test_mdl_without_our_description_is_read_by_its_names(tmp_path: Path) -> None:
    if h5py is None:
        pytest.skip(NEEDS_H5PY)
    spec = specs()["gpt2"]
    state = trained_checkpoint(spec)
    table, aliases = torch_names.table_for(spec.describe())
    with h5py.File(tmp_path / "zoo.mdl", "w") as f:   # as the model zoo writes it: names only
        for name, array in torch_names.to_torch(table, aliases, state.weights).items():
            f.create_dataset(f"model.{name}", data=array)
        f.attrs["global_step"] = np.int64(40)             # a scalar may be an attribute
        f.create_dataset("lr_scheduler.last_epoch", data=np.int64(40))
    loaded = ckpt.load(tmp_path / "zoo.mdl")
    assert loaded.global_step == 40 and loaded.opt_state == {}
    assert_same_state(ckpt.Checkpoint(40, 40, state.weights, {}, {}), loaded, opt=False)


def test_mdl_as_checkpoint_path_resumes_the_model(tmp_path: Path) -> None:
    """An .mdl handed to --checkpoint_path is read (the trainer's load), not refused with numpy's pickle advice."""
    if h5py is None:
        pytest.skip(NEEDS_H5PY)
    spec = specs()["fc_mnist"]
    state = trained_checkpoint(spec, "sgd")
    convert.main([str(write_npz(tmp_path, state)), str(tmp_path / "model.mdl")])
    loaded = ckpt.load(tmp_path / "model.mdl")
    ckpt.check_compatible(loaded, {l.name: l.param_shapes() for l in spec.layers}, tmp_path / "model.mdl")
    assert_same_state(state, loaded)


def test_mdl_without_h5py_is_one_line(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "model.mdl").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    monkeypatch.setitem(sys.modules, "h5py", None)   # import h5py fails, as where it is not installed
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(tmp_path / "model.mdl")
    assert "needs h5py" in str(err.value) and "pickle" not in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- PyTorch state_dict (torch)

def test_torch_state_dict_loads_weights_only_into_a_torch_mlp(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    spec = specs()["fc_mnist"]
    state = trained_checkpoint(spec, "sgd")
    convert.main([str(write_npz(tmp_path, state)), str(tmp_path / "model.pt")])

    class MNIST(torch.nn.Module):   # the model zoo's FC-MNIST module's names
        def __init__(self):
            super().__init__()
            self.fc_layers = torch.nn.ModuleList([torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)])
            self.last_layer = torch.nn.Linear(4, 3)

        def forward(self, x):
            for layer in self.fc_layers:
                x = torch.relu(layer(x))
            return self.last_layer(x)

    module = MNIST()
    module.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    program = lower_spec(spec)   # what every path runs; its live values hold the logits
    ctx = ShardContext(0, 0, 5, slice(0, 5), train=False, labels=np.zeros(5, np.int64))
    ours = model_forward(program, x, state.weights, ctx)[0][program.program["logits"]]
    with torch.no_grad():
        np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "bert", "gpt2_tied", "bert_tied"])
def test_torch_round_trip_is_exact(tmp_path: Path, family: str) -> None:
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    state = trained_checkpoint(specs()[family])
    convert.main([str(write_npz(tmp_path, state)), str(tmp_path / "model.bin"), "--format", "torch"])
    loaded = torch.load(tmp_path / "model.bin", weights_only=True)
    assert all(t.dtype == torch.float32 for t in loaded.values())
    convert.main([str(tmp_path / "model.bin"), str(tmp_path / "back.npz")])
    # a state_dict holds the weights alone: no step, no optimizer state
    assert_same_state(ckpt.Checkpoint(0, 0, state.weights, {}, {}), ckpt.load(tmp_path / "back.npz"), opt=False)


def test_torch_file_as_checkpoint_says_to_convert(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    torch.save({"last_layer.weight": torch.zeros(3, 4)}, tmp_path / "model.pt")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(tmp_path / "model.pt")
    assert "cs_convert_checkpoint" in str(err.value) and "pickle" not in str(err.value)


def test_no_torch_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    source = write_npz(tmp_path, trained_checkpoint(specs()["fc_mnist"], "sgd"))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as exit_:
        convert.main([str(source), str(tmp_path / "model.pt")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs torch" in err and not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("args,says", [(["missing.npz", "out.pt"], "does not exist"),
                                       (["{src}", "out.xyz"], "--format"),
                                       (["{src}", "{src}"], "is the source")])
def test_bad_arguments_are_one_line(tmp_path: Path, capsys, args, says) -> None:
    source = write_npz(tmp_path, trained_checkpoint(specs()["fc_mnist"], "sgd"))
    argv = [a.format(src=source) if "{" in a else str(tmp_path / a) for a in args]
    with pytest.raises(SystemExit) as exit_:
        convert.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err


@pytest.mark.cluster
def test_a_run_resumed_from_an_mdl_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """csrun_cpu --checkpoint_path model.mdl (converted from step 3's checkpoint) goes on to step 6
    with exactly the weights of the run that never stopped."""
    if h5py is None:
        pytest.skip(NEEDS_H5PY)
    from tests.cluster_utils import final_weights, run_cpu, write_params
    params = write_params(tmp_path, runconfig={"max_steps": 6, "checkpoint_steps": 3, "log_steps": 3, "seed": 3})
    whole = run_cpu(params, tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    convert.main([str(tmp_path / "whole" / "checkpoint_3.npz"), str(tmp_path / "step3.mdl")])
    resumed = run_cpu(params, tmp_path / "resumed", "train", "--checkpoint_path", str(tmp_path / "step3.mdl"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = resumed.stdout + resumed.stderr
    assert "pickle" not in out and "step3.mdl at global step 3" in out, out
    assert sorted(p.name for p in (tmp_path / "resumed").glob("checkpoint_*")) == ["checkpoint_6.npz"]
    expected, got = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_version_and_help(capsys) -> None:
    from cs_runtime.version import version
    with pytest.raises(SystemExit) as exit_:
        convert.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"cs_convert_checkpoint (cs-emulator) {version()}"
    with pytest.raises(SystemExit):
        convert.main(["--help"])
    assert "--format" in capsys.readouterr().out
