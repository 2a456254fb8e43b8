"""The runtime every role shares (the layers: docs/design.md#layers-of-the-code).

    errors.py          the exception taxonomy: the root error, the user-input branch (exit 2, no restart)
    config.py          params.yaml: load and check every key (Params)
    params_compat.py   the model zoo's params files as shipped: spellings, the 2.x trainer layout, overrides
    env.py             every CS_* environment variable: name, default, parser, meaning
    flags.py           the one flag-spelling rule of the CLIs (--a_b == --a-b)
    spans.py           the timeline's span recorder (trace.py sends and merges the spans)
    trace.py           the timeline: spans from every process merged by the chief into trace.json
    roles.py           the roles of a job, named once: module or entry point, service or task, core share
    run_args.py        run.py's flags (RunArgs) and functions (UserFunctions)
    runner.py          run(): what a model's run.py calls; hands over to the role's entry point
    user_script.py     running the user's script as one role (python -m chief|worker run.py ...)
    checkpoint.py      checkpoints on disk; the one flatten/unflatten of weights and optimizer state
    checkpoint_mdl.py  the model zoo's HDF5 checkpoint layout (.mdl), with h5py
    run_lock.py        a model_dir belongs to one run: the lock that names its holder
    torch_names.py     this project's models' weights under a torch module's names and layout
    lm_checks.py       what the language-model examples check in their params and data
    probe_line.py      the line a cs_input_analyzer probe prints
    version.py         the installed version, for every command's --version
    units.py           byte units (KB, MiB, ...) and their human spelling
    import_names.py    the vendor's import names (cerebras_pytorch, cerebras.pytorch, ...) served by our packages

    cli/               the console commands (csrun_wse, csrun_cpu, cs_system, csctl, ...)
    process/           a process of a job: identity, orphan handling, its side of the directory
    wire/ numerics/ data/ compiler/ launch/ appliance/ memoryx/ swarmx/: each says what it holds.
"""
