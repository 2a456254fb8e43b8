"""The command line's rough edges: --version everywhere, csrun_cpu --help, a bad
--mode said once, an unusable model_dir in one line, progress with an ETA.

    python -m pytest tests/test_cli.py -q
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cs_runtime.version import version
from tests.cluster_utils import FC_MNIST, tool, write_params

COMMANDS = ["csrun_cpu", "csrun_wse", "csctl", "cs_system", "cs_input_analyzer"]


def run(cmd: list[str], cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.cluster
def test_every_command_says_its_version(command: str) -> None:
    result = run([tool(command), "--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{command} (cs-emulator) {version()}"


@pytest.mark.cluster
def test_run_py_says_its_version() -> None:
    result = run([sys.executable, FC_MNIST, "--version"])
    assert result.returncode == 0 and result.stdout.strip() == f"run.py (cs-emulator) {version()}"


@pytest.mark.cluster
def test_csrun_cpu_help_lists_its_options() -> None:
    result = run([tool("csrun_cpu"), "--help"])
    assert result.returncode == 0
    for option in ("--trace", "--version", "--help", "--override", "--mode"):
        assert option in result.stdout
    bad = run([tool("csrun_cpu"), "--bogus"])
    assert bad.returncode == 2 and "unrecognized argument: --bogus" in bad.stderr and "usage:" in bad.stderr


@pytest.mark.parametrize("launcher", ["csrun_cpu", "csrun_wse"])
@pytest.mark.cluster
def test_a_bad_mode_prints_usage_once(tmp_path: Path, launcher: str) -> None:
    params = write_params(tmp_path)
    result = run([tool(launcher), sys.executable, FC_MNIST, "--mode", "trian", "--params", str(params),
                  "--model_dir", str(tmp_path / "md")])
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert out.count("usage: run.py") == 1 and out.count("invalid choice: 'trian'") == 1, out
    assert "wsjob" not in out


@pytest.mark.cluster
def test_an_unusable_model_dir_is_one_line(tmp_path: Path) -> None:
    params = write_params(tmp_path)
    (tmp_path / "a_file").write_text("")
    result = run([tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
                  "--model_dir", str(tmp_path / "a_file" / "md")])
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: --model_dir {tmp_path / 'a_file' / 'md'}: cannot create or write "
                                     "there (Not a directory)")
    assert "Traceback" not in result.stderr


@pytest.mark.cluster
def test_progress_lines_show_step_of_total_and_an_eta(tmp_path: Path) -> None:
    params = write_params(tmp_path, runconfig={"max_steps": 6, "log_steps": 3, "checkpoint_steps": 0})
    result = run([tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
                  "--model_dir", str(tmp_path / "md")])
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines() if l.startswith("| Train ")]
    assert [re.search(r"Progress=(\d+/\d+), ETA=(\d+:\d\d:\d\d)$", l).group(1) for l in lines] == ["3/6", "6/6"]
    assert lines[-1].endswith("ETA=0:00:00")
