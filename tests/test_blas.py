"""The BLAS threads rule (cs_runtime/numerics/blas.py): a small dense layer's products on
one thread, a large one's on the process's own count, every other layer's on one thread,
the same on every path."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics import blas, model
from cs_runtime.numerics.model import LayerSpec, ModelSpec, ShardContext, init_weights, mlp_spec

needs_setter = pytest.mark.skipif(blas.started_with() == 0,
                                  reason="numpy's BLAS here is not an OpenBLAS with a thread setter: nothing to set")


def test_the_rule_by_flops():
    if blas.started_with() == 0:
        assert blas.threads_for(1) == 0      # nothing can be told: nothing changes
        return
    assert blas.threads_for(2 * 128 * 784 * 256) == 1
    assert blas.threads_for(blas.SMALL_PRODUCT_FLOPS - 1) == 1
    assert blas.threads_for(blas.SMALL_PRODUCT_FLOPS) == blas.started_with()
    assert blas.threads_for(2 * 512 * 2048 * 2048) == blas.started_with()


@needs_setter
def test_a_small_layer_runs_on_one_thread_and_the_count_comes_back_after_it():
    before = blas.current()
    with blas.dense_layer_threads(128, 784, 256):
        assert blas.current() == 1
        a = np.ones((64, 64), np.float32)
        assert np.array_equal(a @ a, np.full((64, 64), 64, np.float32))   # BLAS works on the new count
    assert blas.current() == before
    with pytest.raises(RuntimeError):
        with blas.dense_layer_threads(128, 784, 256):
            raise RuntimeError("a layer failed")
    assert blas.current() == before                                    # also after a failure
    with blas.dense_layer_threads(512, 2048, 2048):
        assert blas.current() == blas.started_with()


def _record_threads(monkeypatch, seen: list):
    """Note the BLAS thread count each layer's maths runs on."""
    for name in ("forward", "backward"):
        original = getattr(model.program_layer, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, args[1], blas.current()))
            return _original(*args, **kwargs)
        monkeypatch.setattr(model.program_layer, name, recorded)


@needs_setter
@pytest.mark.parametrize("hidden, rows, threads", [([256, 128], 128, "one"), ([2048], 4096, "own")])
def test_every_layer_of_a_model_step_follows_the_rule(monkeypatch, hidden, rows, threads):
    """What the CPU path and each WSE call (model.layer_forward, model.layer_backward):
    one thread for the small preset's layers, the process's count for large ones."""
    spec = lower_spec(mlp_spec("m", [784, *hidden, 10], "relu", 0.0))
    weights = init_weights(spec, 0)
    x = np.random.default_rng(0).random((rows, 784), dtype=np.float32)
    y = np.arange(rows) % 10
    seen: list = []
    _record_threads(monkeypatch, seen)
    logits, caches = model.model_forward(spec, x, weights, ShardContext(0, 1, rows, slice(0, rows), True, labels=y))
    result = model.model_loss(spec, logits, y, rows)
    model.model_backward(spec, result.delta, caches, weights, 1)
    assert len(seen) == 2 * len(spec.layers)
    expected = {"one": lambda layer: 1,
                "own": lambda layer: blas.threads_for(2 * rows * layer.in_features * layer.out_features)}[threads]
    for _, index, used in seen:
        assert used == expected(spec.layers[index]), seen
    if threads == "own":
        assert blas.started_with() in [used for _, _, used in seen]    # the 4096 x 784 x 2048 layers
    assert blas.current() == blas.started_with()                       # and back after the step


@needs_setter
def test_other_layers_run_on_one_thread():
    """A transformer layer's products run on one thread whatever their size (blas.unit_threads)."""
    before = blas.current()
    for rows in (8, 4096):
        block = LayerSpec("block0", "transformer_block", 256, 256, "gelu", num_heads=4, ffn_features=1024, max_len=16)
        with model.blas_threads(ModelSpec("t", (block,)), block, np.zeros((rows, 256))):
            assert blas.current() == 1
        assert blas.current() == before


def _step(spec, weights, x, y):
    rows = len(x)
    logits, caches = model.model_forward(spec, x, weights, ShardContext(0, 1, rows, slice(0, rows), True, labels=y))
    result = model.model_loss(spec, logits, y, rows)
    return result.loss, model.model_backward(spec, result.delta, caches, weights, 1)


@needs_setter
def test_a_small_models_step_has_the_same_bits_whatever_count_its_process_started_with(monkeypatch):
    """The CPU path starts with the host's cores, a WSE of two with half: the small preset's
    step must not tell them apart (OpenBLAS's one-thread kernels differ in the last bit
    for some of its shapes, 128 x 784 x 256 forward among them)."""
    spec = lower_spec(mlp_spec("m", [784, 256, 128, 10], "relu", 0.0))
    weights = init_weights(spec, 0)
    x = np.random.default_rng(1).random((128, 784), dtype=np.float32)
    y = np.arange(128) % 10
    loss, grads = _step(spec, weights, x, y)
    openblas = blas._openblas()
    before = openblas.current
    monkeypatch.setattr(openblas, "started_with", 1)     # as a process started on one thread
    openblas.use(1)
    try:
        loss1, grads1 = _step(spec, weights, x, y)
    finally:
        openblas.use(before)
    assert loss1 == loss
    for g, g1 in zip(grads, grads1):
        for name in g:
            np.testing.assert_array_equal(g1[name], g[name], err_msg=name)


def test_a_jobs_processes_get_openblass_short_spin_and_the_allocators_settings_unless_set(monkeypatch):
    from cs_runtime.env import ALLOCATOR, BLAS_SPIN
    from cs_runtime.launch.launcher import numerics_env
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    name, short = BLAS_SPIN
    assert numerics_env({}, 2)[name] == short and numerics_env({}, 2)["OPENBLAS_NUM_THREADS"] == "2"
    assert name not in numerics_env({}, 1)          # one thread: nothing spins
    assert numerics_env({name: "20"}, 2)[name] == "20"   # the user's own
    for threads in (1, 2):   # every process: the allocator keeps freed memory for reuse
        assert all(numerics_env({}, threads)[k] == v for k, v in ALLOCATOR)
    assert numerics_env({"MALLOC_TRIM_THRESHOLD_": "0"}, 1)["MALLOC_TRIM_THRESHOLD_"] == "0"


@pytest.mark.cluster
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator's settings are glibc's")
def test_with_the_allocators_settings_a_freed_array_is_reused_not_faulted_in_again():
    from cs_runtime.launch.launcher import numerics_env
    count = ("import numpy as np, resource\n"
             "pages = 48 * 2**20 // 4096\n"
             "for _ in range(3): a = np.ones(pages * 1024, np.float32); del a   # warm\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "for _ in range(10): a = np.ones(pages * 1024, np.float32); del a\n"
             "print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10 / pages)\n")
    plain = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    faults = {name: float(subprocess.run([sys.executable, "-c", count], env=env, capture_output=True, text=True,
                                         timeout=60, check=True).stdout)
              for name, env in (("plain", plain), ("set", numerics_env(plain, 1)))}
    # Faults per 4 KB page of a 48 MB array: plain, each allocation is new memory (one fault a
    # page, or one per 2 MB huge page: still far above what reuse costs); set, almost none.
    assert faults["set"] < 0.01 and faults["set"] < faults["plain"] / 4, faults
