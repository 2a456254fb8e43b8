"""The console commands pip installs (setup.cfg's entry points): argparse, then a library call.

    csrun_wse.py          csrun_wse: run a model script on the emulated CS system
    csrun_cpu.py          csrun_cpu: the same script in one process (the oracle), compile- or validate-only
    cs_system.py          cs_system: a long-lived emulated CS system that many jobs share
    csctl.py              csctl: look at and steer the jobs of a CS system
    cs_input_analyzer.py  cs_input_analyzer: how many input workers a model needs
    convert_checkpoint.py cs_convert_checkpoint: checkpoints to and from PyTorch and the model zoo's .mdl
"""
