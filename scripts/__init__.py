"""Development tools, run from a checkout (python scripts/NAME.py); not installed. The console
commands are cs_runtime/cli/.

    bench.py, bench_baselines.py  the benchmark and its baselines (docs/benchmarks.md)
    bench_models.py       the models preset's models written by others, in process and as a run.py
    step_budget.py        where a step's CPU goes: each process and thread of one job (docs/benchmarks.md)
    batch_study.py        the batch-size study
    published_estimates.py  the compiler's estimate beside published measured throughputs (docs/benchmarks.md)
    control_plane_bench.py  the launcher's control plane with many simulated tasks
    chaos.py, soak.py     faults thrown at whole jobs; many jobs back to back
    compare_checkouts.py, same_bits.py  do two versions of the code train to the same bits?
    modelzoo_data.py      the model zoo's data processors as shipped, on data made here (a checkout brought in)
    modelzoo_oracle.py    a Cerebras model zoo checkout's own run.py on the emulator against torch eager
"""
