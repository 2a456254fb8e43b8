"""cs_runtime/numerics/compiled.py: the optional C loops are taken only when built, and
only when built from the C file of this checkout (an editable install's stale build)."""
import types

import pytest

from cs_runtime.numerics import compiled


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

