"""Starting and supervising a job's processes.

    job.py           a job as a library: JobOptions -> layout, keys, CS system, tasks, supervision
    launcher.py      spawn, process groups, the supervisor that stops everything on a failure
    backends.py      where a job's processes run: Local, Ssh, Slurm and CsSystem, one interface, chosen once
    remote.py        SSH and srun: hostfiles, placement, starting tasks and services remotely
    task.py          python -m cs_runtime.launch.task: the per-host task wrapper
    directory.py     the job's directory: registration and heartbeats of every process (the server side)
    front_door.py    a shared CS system's client: keys, owner credential, submit and follow a job
    local_jobs.py    this user's jobs with a CS system of their own, for csctl: the registry, cancel, label
    restart.py       --max_restarts: run a job again from its latest checkpoint
    target.py        what `python run.py CPU|CSX ...` does before any role runs (the model zoo's targets)
    precheck.py      before the cluster starts: the script's functions and params, checked in one process
    reachability.py  an address answers: TCP, then a ZeroMQ handshake with the job's keys
"""
