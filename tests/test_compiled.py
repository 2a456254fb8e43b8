"""cs_runtime/numerics/compiled.py: the optional C loops are taken only when built, and
only when built from the C file of this checkout (an editable install's stale build)."""
import types

import numpy as np
import pytest

from cs_runtime.numerics import compiled, precision


def test_a_module_that_is_not_built_is_none_without_a_word(recwarn):
    assert compiled.load("_no_such_loops", api=1) is None
    assert not recwarn.list


def test_a_module_built_from_another_version_is_left_alone_with_a_warning(monkeypatch):
    stale = types.ModuleType("cs_runtime.numerics._convert")
    stale.__file__ = "/somewhere/_convert.cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setattr(compiled.importlib, "import_module", lambda name: stale)
    with pytest.warns(RuntimeWarning, match=r"_convert\.cpython-311.* was built from another version of "
                                            r"_convert\.c: using the numpy path instead \(`pip install -e \.` "
                                            r"rebuilds it\)"):
        assert compiled.load("_convert", api=1) is None
    stale.API = 2
    with pytest.warns(RuntimeWarning, match="another version"):
        assert compiled.load("_convert", api=1) is None
    stale.API = 1
    assert compiled.load("_convert", api=1) is stale



def test_the_conversion_loops_refuse_a_format_or_buffers_they_cannot_take():
    """The C loops (_convert.c) check what they are handed: a format of 16 bits, buffers
    of one element count, a writable target; and they say when a source held inf or nan."""
    loops = precision._compiled
    if loops is None:
        pytest.skip("the conversions' C loops are not built (no C compiler at install)")
    floats, patterns = np.zeros(8, np.float32), np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="no 16-bit format with 5 exponent and 9 mantissa bits"):
        loops.encode(floats, patterns, 5, 9)
    with pytest.raises(ValueError, match="same number of elements"):
        loops.decode(patterns[:7], floats, 5, 10)
    with pytest.raises(ValueError, match="same number of elements"):
        loops.round(floats, np.zeros(7, np.float32), 5, 10)
    with pytest.raises(TypeError):
        loops.encode(floats, bytes(16), 5, 10)                       # a read-only target
    assert loops.encode(floats, patterns, 5, 10) is False
    floats[3] = np.inf
    assert loops.encode(floats, patterns, 5, 10) is True            # inf: left to the numpy path
    assert loops.decode(np.array([0x7C00, 0], np.uint16), np.zeros(2, np.float32), 5, 10) is True


def test_the_gelu_loops_refuse_buffers_of_other_sizes():
    from cs_runtime.numerics import kernels
    loops = kernels._gelu_loops
    if loops is None:
        pytest.skip("the exact GELU's C loops are not built (no C compiler at install)")
    x, scratch = np.zeros(8, np.float32), [np.zeros(8) for _ in range(3)]
    with pytest.raises(ValueError, match="every buffer must hold the same number of elements"):
        loops.prepare(x, scratch[0], scratch[1], np.zeros(7))
    with pytest.raises(ValueError, match="every buffer must hold the same number of elements"):
        loops.finish(x, *scratch, np.zeros(8, np.float32), np.zeros(8))       # slope: float32 expected
    loops.prepare(x, *scratch)
    assert np.array_equal(scratch[0], np.ones(8)) and np.array_equal(scratch[2], np.zeros(8))   # t = 1 at x = 0
