"""Whole runs against bad checkpoints and full disks.

- a latest checkpoint cut short: the resume takes the newest one that loads,
  says which it skipped and why, and ends bit-identical to an undisturbed run;
- a disk that fills up during a checkpoint (a small tmpfs in a mount namespace
  of its own, so nothing outlives the test): one line, exit 2, the previous
  checkpoint intact, no restart spent on it.

    python -m pytest tests/test_checkpoint_faults.py -q
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cs_runtime.checkpoint import load
from scripts.chaos import full_disk_missing
from tests.cluster_utils import FC_MNIST, run_cpu, tool, write_params

pytestmark = pytest.mark.cluster  # the tests here start processes

RUN = {"max_steps": 8, "checkpoint_steps": 2}


def weights_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as ck:
        return {k: ck[k] for k in ck.files if k.startswith(("model/", "optimizer/"))}


def test_resume_skips_a_truncated_latest_checkpoint_and_ends_bit_identical(tmp_path):
    params = write_params(tmp_path, runconfig=RUN)
    undisturbed = tmp_path / "a"
    assert run_cpu(params, undisturbed).returncode == 0
    resumed = tmp_path / "b"
    shutil.copytree(undisturbed, resumed)
    cut = resumed / "checkpoint_8.npz"
    cut.write_bytes(cut.read_bytes()[:-8])
    result = run_cpu(params, resumed)
    assert result.returncode == 0, result.stderr[-2000:]
    skipped = [l for l in result.stderr.splitlines() if "skipping" in l]
    assert len(skipped) == 1 and f"skipping checkpoint {cut} is corrupt" in skipped[0], result.stderr
    assert "set aside as checkpoint_8.npz.corrupt" in skipped[0]   # kept, not overwritten by the new step 8
    assert "resuming from an older one" in skipped[0]
    assert f"Restored checkpoint {resumed / 'checkpoint_6.npz'} at global step 6" in result.stderr
    want, got = weights_of(undisturbed / "checkpoint_8.npz"), weights_of(cut)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def on_small_tmpfs(mountpoint: Path, size_kib: int, argv: list[str]) -> subprocess.CompletedProcess:
    """argv with a tmpfs of size_kib KiB at mountpoint, in a mount namespace that ends with it."""
    mountpoint.mkdir()
    script = f'mount -t tmpfs -o size={size_kib}k tmpfs "$1" && shift && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(mountpoint), *argv],
                          capture_output=True, text=True, timeout=180)


# The small model's checkpoint is ~420 KiB: the first fits beside the run's other files, the second not.
TMPFS_KIB = 800


@pytest.mark.parametrize("path", ["cpu", "wse"])
def test_a_full_disk_during_a_checkpoint_is_one_line_exit_2_and_never_restarted(tmp_path, path):
    why = full_disk_missing()
    if why:
        pytest.skip(f"a full disk needs a tmpfs in a mount namespace: {why}")
    params = write_params(tmp_path, runconfig=RUN)
    model_dir = tmp_path / "disk" / "m"
    launcher = [tool("csrun_cpu")] if path == "cpu" else [tool("csrun_wse"), "--max_restarts", "2"]
    # Inside the namespace the model_dir is on the tmpfs; keep a copy of what it held on the way out.
    keep = tmp_path / "kept"
    argv = ["sh", "-c", f'"$@"; rc=$?; cp -r {model_dir} {keep}; exit $rc', "sh",
            *launcher, sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
            "--model_dir", str(model_dir)]
    result = on_small_tmpfs(tmp_path / "disk", TMPFS_KIB, argv)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "restarting" not in out, out[-3000:]
    errors = [l for l in out.splitlines() if "cannot write checkpoint" in l]
    assert errors, out[-3000:]
    assert f"cannot write checkpoint {model_dir}/checkpoint_" in errors[0]
    assert "no space left on the device (ENOSPC); checkpoints kept: checkpoint_2.npz" in errors[0]
    kept = sorted(p.name for p in keep.iterdir() if p.name.startswith(("checkpoint_", ".checkpoint_")))
    assert kept == ["checkpoint_2.npz"]
    assert load(keep / "checkpoint_2.npz").global_step == 2
    if path == "wse":
        failed = [l for l in out.splitlines() if "job failed" in l]
        assert len(failed) == 1 and "chief 0" in failed[0] and "exit code 2" in failed[0], out[-3000:]
