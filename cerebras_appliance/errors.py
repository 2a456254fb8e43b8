"""The appliance client's errors the model zoo catches or raises."""


class ApplianceClientException(Exception):
    """A failure reported by the cluster."""


class ApplianceNanError(ApplianceClientException):
    """A NaN or inf loss (the model zoo raises it when it sees one)."""


class ApplianceCompilationError(ApplianceClientException):
    """The model did not compile."""


class ApplianceRuntimeJobError(ApplianceClientException):
    """The job failed while it ran."""


class ApplianceUnknownError(ApplianceClientException):
    """Anything else the cluster reports."""


class ApplianceDeadlockError(ApplianceClientException):
    """The job's processes stopped waiting on one another (the model zoo's restartable trainer
    restarts on it)."""


class ClusterJobCancelledByCsctl(ApplianceClientException):
    """The job was cancelled by `csctl cancel job` (the restartable trainer does not restart it)."""
