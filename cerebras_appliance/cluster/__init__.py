"""cerebras.appliance.cluster: the job's link to the cluster's services.

    client.py   TelemetryClient: metrics a job pushes to the cluster's telemetry
"""
