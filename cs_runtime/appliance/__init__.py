"""The shared CS system (`cs_system serve`) and its client.

    server.py  the CS system: front door, job queue, one-job service processes from a warm pool
    client.py  the client side: keys, owner credential, submit and follow a job
"""
