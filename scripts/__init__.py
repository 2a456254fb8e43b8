"""Command lines and development tools.

Console commands (setup.cfg's entry points):
    csrun_wse.py          csrun_wse: run a model script on the emulated CS system
    csrun_cpu.py          csrun_cpu: the same script in one process (the oracle), compile- or validate-only
    cs_system.py          cs_system: a long-lived emulated CS system that many jobs share
    csctl.py              csctl: look at and steer the jobs of a CS system
    cs_input_analyzer.py  cs_input_analyzer: how many input workers a model needs
    convert_checkpoint.py cs_convert_checkpoint: checkpoints to and from PyTorch and the model zoo's .mdl

Development tools (python scripts/NAME.py):
    bench.py, bench_baselines.py  the benchmark and its baselines (docs/benchmarks.md)
    batch_study.py        the batch-size study
    control_plane_bench.py  the launcher's control plane with many simulated tasks
    chaos.py, soak.py     faults thrown at whole jobs; many jobs back to back
    compare_checkouts.py, same_bits.py  do two versions of the code train to the same bits?
"""
