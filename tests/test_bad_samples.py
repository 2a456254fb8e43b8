"""Every batch is checked before a model computes on it: dtype, shape, label
range (the ignore index of token models allowed), finite values. A bad sample
stops the run with one line naming the input worker, the step and the sample,
exit 2, and no restart (a restart would meet the same sample).

    python -m pytest tests/test_bad_samples.py -q
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cs_runtime.config import load_params
from cs_runtime.data.inputs import InputStream, fetch
from cs_runtime.data.mnist import load_mnist
from cs_runtime.numerics.batch_check import BadBatch, bad_input_line, check_batch
from cs_runtime.numerics.kernels import IGNORE_INDEX
from cs_runtime.numerics.model import LayerSpec, ModelSpec, mlp_spec
from tests.cluster_utils import REPO, tool, write_params

MLP = mlp_spec("m", [4, 8, 3], "relu", 0.0)
LM = ModelSpec("lm", (LayerSpec("emb", "embedding", 50, 8, max_len=6),
                      LayerSpec("head", "lm_head", 8, 50)))


def features(rows: int = 5) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((rows, 4), np.float32), np.arange(rows, dtype=np.int64) % 3


def test_a_good_batch_passes():
    check_batch(MLP, *features())
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    labels = np.full((2, 6), IGNORE_INDEX, np.int64)
    labels[0, 2] = 49
    check_batch(LM, ids, labels)   # the ignore index is no error


@pytest.mark.parametrize("label, why", [(-3, "label -3 outside [0, 3)"), (3, "label 3 outside [0, 3)"),
                                        (IGNORE_INDEX, f"label {IGNORE_INDEX} outside [0, 3)")])
def test_a_classifiers_labels_must_be_classes(label, why):
    x, y = features()
    y[4] = label
    with pytest.raises(BadBatch, match=re.escape(why)) as caught:
        check_batch(MLP, x, y)
    assert caught.value.sample == 4


def test_a_token_models_labels_are_classes_or_the_ignore_index():
    ids = np.zeros((3, 6), np.int32)
    labels = np.zeros((3, 6), np.int64)
    labels[1, 3] = -1
    with pytest.raises(BadBatch, match=f"label -1 outside .0, 50. and not the ignore index {IGNORE_INDEX}") as caught:
        check_batch(LM, ids, labels)
    assert caught.value.sample == 1
    labels[1, 3] = 0
    ids[2, 5] = 50
    with pytest.raises(BadBatch, match=r"token id 50 outside \[0, 50\)") as caught:
        check_batch(LM, ids, labels)
    assert caught.value.sample == 2


@pytest.mark.parametrize("x, y, why", [
    (np.zeros((5, 3), np.float32), np.zeros(5, np.int64), r"shape \(5, 3\), the model needs \[batch, 4\]"),
    (np.zeros((5, 4), np.int32), np.zeros(5, np.int64), "features are int32, expected floats"),
    (np.zeros((5, 4), np.float32), np.zeros(5, np.float32), "labels are float32, expected integers"),
    (np.zeros((5, 4), np.float32), np.zeros(4, np.int64), "5 feature rows but 4 label rows"),
    (np.zeros((5, 4), np.float32), np.zeros((5, 1), np.int64), r"labels have shape \(5, 1\)"),
])
def test_a_batch_of_the_wrong_dtype_or_shape_is_refused(x, y, why):
    with pytest.raises(BadBatch, match=why):
        check_batch(MLP, x, y)


def test_token_ids_longer_than_the_positions_are_refused():
    with pytest.raises(BadBatch, match=r"shape \(2, 7\), the model needs \[batch, 1..6\]"):
        check_batch(LM, np.zeros((2, 7), np.int32), np.zeros((2, 7), np.int64))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_features_must_be_finite(value):
    x, y = features()
    x[2, 1] = value
    with pytest.raises(BadBatch, match=f"feature value {value} is not finite") as caught:
        check_batch(MLP, x, y)
    assert caught.value.sample == 2


def _program_spec(target_dtype="int64"):
    """What check_batch reads of a captured model: its inputs as captured, its scores, its ignored label."""
    values = {"x": [[8, 3, 4], "float32"], "target": [[8], target_dtype], "scores": [[8, 5], "float32"]}
    return SimpleNamespace(program={"inputs": ["x", "target"], "values": values, "logits": "scores",
                                    "ignore_index": -100})


def test_a_captured_models_batch_matches_its_capture_whatever_the_batch_size():
    spec = _program_spec()
    check_batch(spec, np.zeros((3, 3, 4), np.float32), np.array([0, 4, -100]))
    with pytest.raises(BadBatch, match=r"input has shape \(3, 12\), the model needs \[batch, 3, 4\]"):
        check_batch(spec, np.zeros((3, 12), np.float32), np.zeros(3, np.int64))
    with pytest.raises(BadBatch, match=r"label 5 outside \[0, 5\)") as bad:
        check_batch(spec, np.zeros((3, 3, 4), np.float32), np.array([0, 1, 5]))
    assert bad.value.sample == 2
    with pytest.raises(BadBatch, match="target is float32, the model was captured with int64"):
        check_batch(spec, np.zeros((3, 3, 4), np.float32), np.zeros(3, np.float32))
    x = np.zeros((3, 3, 4), np.float32)
    x[1, 2, 0] = np.nan
    with pytest.raises(BadBatch, match="input value is not finite") as bad:
        check_batch(spec, x, np.zeros(3, np.int64))
    assert bad.value.sample == 1


def test_a_captured_regression_takes_float_targets():
    spec = _program_spec("float32")
    spec.program["values"]["target"] = [[8, 5], "float32"]
    spec.program["logits"] = ""
    check_batch(spec, np.zeros((2, 3, 4), np.float32), np.ones((2, 5), np.float32))


def test_float_labels_reach_the_check_as_floats_never_cast_to_classes():
    x, y = features()
    fetched_x, fetched_y = fetch((x, y + 0.7), np.arange(5))
    assert fetched_y.dtype == np.float32 and np.array_equal(fetched_y, (y + 0.7).astype(np.float32))
    with pytest.raises(BadBatch, match="labels are float32, expected integers"):
        check_batch(MLP, fetched_x, fetched_y)
    assert fetch((x, y), np.arange(5))[1].dtype == np.int64


def test_the_line_counts_steps_from_one_and_rows_in_the_global_batch():
    line = bad_input_line(BadBatch("label 12 outside [0, 10)", 5), "train", 6, 32, "input worker 1")
    assert line == "bad input from input worker 1: train step 7, sample 37 of the global batch: " \
                   "label 12 outside [0, 10)"


# --------------------------------------------------------------------------
# whole runs: the CPU path and the CS system, with restarts allowed
# --------------------------------------------------------------------------

BAD_STEP, BAD_ROW = 3, 41   # the sample spoilt: row 41 of global batch 3 (the second WSE's half)

RUN_PY = """
import sys
sys.path.insert(0, {repo!r})
import numpy as np
from examples.fc_mnist.run import model_fn, eval_input_fn
from cs_runtime.data.mnist import load_mnist
from cs_runtime.runner import run

def train_input_fn(params):
    x, y = load_mnist(params.train_input.data_dir, "train")
    x, y = x.copy(), y.astype(np.int64)
    {spoil}
    return x, y

if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn)
"""

SPOILS = {
    "negative label": ("y[INDEX] = -3", "label -3 outside [0, 10)"),
    "label past the classes": ("y[INDEX] = 12", "label 12 outside [0, 10)"),
    "missing feature": ("x = x[:, :783]", "features have shape (ROWS, 783), the model needs [batch, 784]"),
    "not a number": ("x[INDEX, 100] = np.nan", "feature value nan is not finite"),
}


def spoilt_run(tmp_path: Path, spoil: str) -> tuple[Path, Path, int]:
    """params, run.py with one sample spoilt, and that sample's data set index."""
    params = write_params(tmp_path, runconfig={"max_steps": 8, "checkpoint_steps": 2})
    p = load_params(params)
    x, _ = load_mnist(p.train_input.data_dir, "train")
    stream = InputStream.build("train", (x, np.zeros(len(x), np.int64)), p.train_input, p.runconfig.seed)
    index = int(stream.plan.global_indices(BAD_STEP)[BAD_ROW])
    script = tmp_path / "run.py"
    script.write_text(RUN_PY.format(repo=str(REPO), spoil=spoil.replace("INDEX", str(index))))
    return params, script, index


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(SPOILS))
def test_cpu_path_names_the_step_sample_and_data_set_index(tmp_path, case):
    spoil, why = SPOILS[case]
    params, script, index = spoilt_run(tmp_path, spoil)
    result = subprocess.run([tool("csrun_cpu"), sys.executable, str(script), "--mode", "train", "--params",
                             str(params), "--model_dir", str(tmp_path / "m")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    if case == "missing feature":   # the whole batch is wrong, the first one at that
        assert errors == [f"error: bad input: train step 1: {why}".replace("ROWS", "64")], result.stderr
    else:
        assert errors == [f"error: bad input: train step {BAD_STEP + 1}, sample {BAD_ROW} of the global batch: "
                          f"{why} (data set index {index})"], result.stderr
        assert sorted(p.name for p in (tmp_path / "m").glob("checkpoint_*")) == ["checkpoint_2.npz"]


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["negative label", "label past the classes", "missing feature"])
def test_the_cs_system_names_the_worker_step_and_sample_and_never_restarts(tmp_path, case):
    spoil, why = SPOILS[case]
    params, script, _ = spoilt_run(tmp_path, spoil)
    cmd = [tool("csrun_wse"), "--num_csx", "2", "--num_workers_per_csx", "1", "--max_restarts", "2",
           sys.executable, str(script), "--mode", "train", "--params", str(params), "--model_dir",
           str(tmp_path / "m")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "restarting" not in out
    bad = [l for l in out.splitlines() if "bad input from" in l]
    if case == "missing feature":   # every WSE's half of the first batch is wrong: each may say so
        assert 1 <= len(bad) <= 2, out[-3000:]
        for line in bad:
            assert re.search(rf"wse\d ERROR bad input from input worker 0: train step 1: "
                             rf"{re.escape(why.replace('ROWS', '32'))}$", line), line
    else:
        assert len(bad) == 1, out[-3000:]
        # row 41 of 64 is the second WSE's row 9; global batch 3 (step 4) comes from worker 1 of 2
        assert re.search(rf"wse1 ERROR bad input from input worker 1: train step {BAD_STEP + 1}, "
                         rf"sample {BAD_ROW} of the global batch: {re.escape(why)}$", bad[0]), bad[0]
    failed = [l for l in out.splitlines() if "job failed" in l]
    assert len(failed) == 1 and "exited with exit code 2 (its line above says why" in failed[0], out[-3000:]


def test_named_features_are_fetched_and_sharded_together_masks_staying_bool():
    """A model of several inputs: the data set's features are a dict; each WSE's rows of
    every array are the rows of the labels it gets."""
    ids = np.arange(40, dtype=np.int64).reshape(10, 4)
    mask = ids % 3 != 0
    y = np.arange(10)
    x, fetched_y = fetch(({"input_ids": ids, "attention_mask": mask}, y), np.array([7, 2, 5]))
    assert x["input_ids"].dtype == np.int32 and x["attention_mask"].dtype == np.bool_
    np.testing.assert_array_equal(x["input_ids"], ids[[7, 2, 5]])
    np.testing.assert_array_equal(x["attention_mask"], mask[[7, 2, 5]])
    section = SimpleNamespace(batch_size=6, shuffle=True, drop_last_batch=True, seed=lambda run_seed: run_seed)
    stream = InputStream.build("train", ({"input_ids": ids, "attention_mask": mask}, y), section, 3)
    assert stream.plan.num_samples == 10
    for shard in stream.shards(1, 2):
        np.testing.assert_array_equal(shard.x["input_ids"], ids[shard.y])   # the same samples' rows
        np.testing.assert_array_equal(shard.x["attention_mask"], mask[shard.y])
