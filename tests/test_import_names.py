"""The vendor's import names the model zoo uses are the emulator's packages.

    python -m pytest tests/test_import_names.py -q
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cs_torch
from tests.cluster_utils import REPO


def test_both_pytorch_names_are_cs_torch_itself() -> None:
    import cerebras.pytorch
    import cerebras_pytorch

    assert cerebras_pytorch is cs_torch and cerebras.pytorch is cs_torch
    # Submodules too, one module object (a copy would make two classes of each name).
    from cerebras.pytorch.core import modes as modes_b
    from cerebras_pytorch.core import modes as modes_a
    assert modes_a is modes_b is importlib.import_module("cs_torch.core.modes")
    assert modes_a.TRAIN_AND_EVAL == "train_and_eval" and modes_a.is_valid("eval_all")
    assert not modes_a.is_valid("predict")


def test_a_missing_submodule_is_named_as_written() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'cerebras_pytorch\.no_such_module'"):
        importlib.import_module("cerebras_pytorch.no_such_module")


def test_cerebras_stays_a_namespace_beside_an_installed_model_zoo(tmp_path: Path) -> None:
    import cerebras
    assert getattr(cerebras, "__file__", None) is None      # no cerebras/__init__.py
    zoo = tmp_path / "cerebras" / "modelzoo"
    zoo.mkdir(parents=True)
    (zoo / "__init__.py").write_text("RELEASE = 'test'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        modelzoo = importlib.import_module("cerebras.modelzoo")
        assert modelzoo.RELEASE == "test"
        assert importlib.import_module("cerebras.pytorch") is cs_torch
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cerebras.modelzoo", None)


def test_appliance_names_of_both_spellings_are_one_module() -> None:
    import cerebras.appliance.errors as b
    import cerebras_appliance.errors as a
    assert a is b and issubclass(a.ApplianceNanError, a.ApplianceClientException)
    from cerebras.appliance.environment import appliance_environ
    import os
    assert appliance_environ is os.environ


def test_byte_units_convert_as_the_model_zoo_calls_them() -> None:
    from cerebras_appliance.utils.units import bytes_to_human, convert_byte_unit
    assert convert_byte_unit(10, "B", src_unit="GB") == 10 * 1000 ** 3
    assert convert_byte_unit(3, "KiB", src_unit="MiB") == 3 * 1024
    assert bytes_to_human(1536) == "1.50KiB"
    with pytest.raises(ValueError, match="unknown byte unit 'GX'"):
        convert_byte_unit(1, "B", src_unit="GX")


def test_log_levels_as_run_utils_sets_them() -> None:
    from cerebras_appliance.log import collect_wsc_log_settings, get_level_name, wsc_logger
    assert get_level_name("info") == logging.INFO and get_level_name("10") == 10 and get_level_name(30) == 30
    with pytest.raises(ValueError, match="invalid logging level 'loud'"):
        get_level_name("loud")
    child = wsc_logger.getChild("crd")
    child.setLevel(logging.DEBUG)
    try:
        assert collect_wsc_log_settings()["crd"] == logging.DEBUG
    finally:
        child.setLevel(logging.NOTSET)


def test_debug_args_round_trip_through_their_file(tmp_path: Path) -> None:
    from cerebras_appliance.run_utils import DebugArgs, get_debug_args, set_default_ini, write_debug_args
    args = DebugArgs()
    args.debug_usr.worker_resource = 4
    set_default_ini(args, ws_opt_speed=True)
    set_default_ini(args, ws_opt_speed=False)        # a default never replaces a value
    path = tmp_path / "debug_args.json"
    write_debug_args(args, str(path))
    back = get_debug_args(str(path))
    assert back.debug_usr.worker_resource == 4 and back.ini.ws_opt_speed is True
    assert json.loads(path.read_text()) == {"debug_usr": {"worker_resource": 4}, "ini": {"ws_opt_speed": True}}
    with pytest.raises(ValueError, match="--debug_args_path .*missing: no such file"):
        get_debug_args(str(tmp_path / "missing"))


def test_setup_installs_every_name() -> None:
    from setuptools.config.setupcfg import read_configuration
    packages = read_configuration(REPO / "setup.cfg")["options"]["packages"]
    for name in ("cerebras_pytorch", "cerebras.pytorch", "cerebras_appliance", "cerebras.appliance",
                 "cerebras_appliance.utils", "cs_torch.core"):
        assert name in packages
    assert "cerebras" not in packages and not any("__pycache__" in p for p in packages)


RUN_PY_OF_A_MODEL_ZOO = '''
import atexit, os, sys
sys.path.append(os.path.join(os.path.dirname(__file__), "../../.."))   # as the model zoo's run.py does
import cerebras_pytorch as cstorch
atexit.register(lambda: print("atexit handlers ran", flush=True))

def get_cluster_config(params):
    return cstorch.distributed.ClusterConfig(num_csx=params["num_csx"])

def main():
    get_cluster_config({"num_csx": 0})

if __name__ == "__main__":
    main()
'''


@pytest.mark.cluster
def test_a_script_that_catches_nothing_ends_on_our_one_line_error(tmp_path: Path) -> None:
    """The model zoo's run.py lets every error out: ours is still one line and exit 2, after the
    script's atexit handlers ran (they stop what the run started)."""
    script = tmp_path / "run.py"
    script.write_text(RUN_PY_OF_A_MODEL_ZOO)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: ClusterConfig: num_csx must be a positive integer, got 0\n"
    assert result.stdout == "atexit handlers ran\n"


def test_any_other_error_and_an_interactive_session_keep_the_previous_hook(monkeypatch) -> None:
    from cs_runtime.errors import exit_on_user_input_error
    from cs_torch.nn import CsTorchError
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen.append(exc))
    exit_on_user_input_error()
    hook = sys.excepthook
    exit_on_user_input_error()                       # installed once however often it is asked
    assert sys.excepthook is hook
    fault = KeyError("ours or the user's: its traceback is kept")
    hook(KeyError, fault, None)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    typo = CsTorchError("a typo at the prompt must not end the session")
    hook(CsTorchError, typo, None)
    assert seen == [fault, typo]
