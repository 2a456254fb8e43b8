"""The console commands pip installs (setup.cfg's entry points): argparse, then a library call.

    csrun_wse.py          csrun_wse: run a model script on the emulated CS system
    csrun_cpu.py          csrun_cpu: the same script in one process (the oracle), compile- or validate-only
    cs_system.py          cs_system: a long-lived emulated CS system that many jobs share
    csctl.py              csctl: look at and steer the jobs of a CS system
    cs_input_analyzer.py  cs_input_analyzer: how many input workers a model needs
    convert_checkpoint.py cs_convert_checkpoint: checkpoints to and from PyTorch and the model zoo's .mdl
"""
# Whichever of them starts first removes the key folders of this user's launchers that died
# without cleaning up (kill -9 of the launcher and of its folder's watcher together): secret
# keys do not wait for the next job.
from cs_runtime.wire.auth import remove_dead_owners_folders  # noqa: E402

remove_dead_owners_folders()
