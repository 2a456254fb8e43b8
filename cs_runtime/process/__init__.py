"""A process of a job, whatever its role: below both the roles and the launcher.

    service.py           its identity from the environment (ProcessEnv), logging, a service's main wrapper
    orphan.py            leaving when its launcher dies: the job's segments and key folder cleaned up
    directory_client.py  its side of the job's directory: register, look peers up, heartbeat
"""
