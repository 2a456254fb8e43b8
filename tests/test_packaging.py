"""The package installs only its own names: the wheel, installed into a fresh virtual environment,
puts no top-level `scripts` package (nor anything else not ours) into site-packages, and each console
command points at a module it holds."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.cluster_utils import REPO

pytestmark = pytest.mark.cluster   # pip and a fresh interpreter run as processes

OURS = {"cs_runtime", "chief", "worker", "wse", "cs_torch", "cerebras_pytorch", "cerebras", "cerebras_appliance"}
COMMANDS = ("csrun_wse", "csrun_cpu", "cs_input_analyzer", "cs_system", "csctl", "cs_convert_checkpoint")


def build_wheel(out: Path) -> Path:
    # From a copy of the tree: setuptools builds in the source folder, and a build/ left there by an
    # earlier build would put stale modules into the wheel (and leave clutter in the checkout).
    source = out.parent / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".venv", "model_dir*", ".pytest_cache"))
    # CC=false: the optional C loops fail to build and are left out (the numpy path serves), which
    # keeps this quick; what the wheel holds besides them is the same.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, env={**_env(), "CC": "false"}, timeout=240)
    if done.returncode != 0 and "No matching distribution found for setuptools" in done.stderr:
        pytest.skip("building the wheel needs setuptools from the package registry, which is not reachable")
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("cs_emulator-*.whl")
    return wheel


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}


def test_the_wheel_installs_only_our_names(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, env=_env(), timeout=240)
    listing = subprocess.run([str(python), "-c", """
import json, importlib.metadata as md
dist = md.distribution("cs-emulator")
tops = {f.parts[0].removesuffix(".py") for f in dist.files if not f.parts[0].endswith((".dist-info", ".data"))
        and f.parts[0] != ".." and f.parts[0] != "__pycache__"}
print(json.dumps(sorted(tops)))
"""], check=True, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=60)
    tops = set(json.loads(listing.stdout))
    assert "scripts" not in tops
    assert tops <= OURS, f"the wheel installs names that are not ours: {sorted(tops - OURS)}"
    assert {"cs_runtime", "chief", "worker", "wse"} <= tops
    # Each console command is installed and points at a module the wheel holds.
    for command in COMMANDS:
        assert (env_dir / "bin" / command).exists(), command
    points = subprocess.run([str(python), "-c", """
import json, importlib.metadata as md
dist = md.distribution("cs-emulator")
files = {str(f) for f in dist.files}
print(json.dumps({ep.name: ep.module.replace(".", "/") + ".py" in files for ep in dist.entry_points}))
"""], check=True, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=60)
    held = json.loads(points.stdout)
    assert set(held) == set(COMMANDS) and all(held.values()), held
