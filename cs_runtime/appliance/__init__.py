"""The shared CS system (`cs_system serve`) and its client.

    server.py  the CS system: front door, job queue, one-job service processes from a warm pool

Its client (keys, owner credential, submit and follow a job) is cs_runtime/launch/front_door.py.
"""
