"""cstorch.backend(): where a cstorch (2.x API) run executes, with the cluster settings.

    backend = cstorch.backend("CSX", artifact_dir="artifacts", compile_dir="/tmp/compile",
                              cluster_config=cstorch.distributed.ClusterConfig(num_csx=2))

The documented names and defaults; the cluster settings live in
`cluster_config` (release 2.3 and later), and DataExecutor's `cs_config`
(earlier releases) is accepted too. An argument this emulator cannot honour
prints one line saying so; none is dropped silently.
"""
from __future__ import annotations

import enum
import os
import sys
import types
from dataclasses import dataclass, field, fields

from cs_runtime.wire.protocol import check_labels

from .csx_settings import csx  # noqa: F401 (cstorch.backends.csx: the CS system's settings)
from .nn import CsTorchError

BACKEND_TYPES = ("CSX", "CPU", "GPU")


def note(message: str) -> None:
    """One line to stderr: an argument the emulator accepts but cannot honour."""
    print(f"cs_torch: {message}", file=sys.stderr, flush=True)


@dataclass
class ClusterConfig:
    """cstorch.distributed.ClusterConfig: the CS system a CSX run uses."""
    mgmt_address: str | None = None
    mgmt_namespace: str | None = None
    credentials_path: str | None = None
    num_csx: int = 1
    max_wgt_servers: int = 24
    max_act_per_csx: int | None = None
    num_workers_per_csx: int = 0
    job_labels: list = field(default_factory=list)
    job_priority: str | None = None
    job_time_sec: int | None = None
    mount_dirs: list = field(default_factory=list)
    python_paths: list = field(default_factory=list)
    disable_version_check: bool = False

    def __post_init__(self):
        for name in ("num_csx", "max_wgt_servers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CsTorchError(f"ClusterConfig: {name} must be a positive integer, got {value!r}")
        n = self.num_workers_per_csx
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CsTorchError(f"ClusterConfig: num_workers_per_csx must be a non-negative integer, got {n!r}")
        self.labels()   # checked now: a bad label is one line before anything starts

    def __hash__(self) -> int:
        """By value (the model zoo caches its backend by its arguments, this among them)."""
        return hash(tuple((f.name, repr(getattr(self, f.name))) for f in fields(self)))

    def labels(self) -> dict[str, str]:
        """job_labels ("key=value" strings, as the real API takes them) as the job's labels (csctl shows them)."""
        labels = {}
        for pair in self.job_labels or []:
            key, sep, value = str(pair).partition("=")
            if not sep:
                raise CsTorchError(f"ClusterConfig: job label {pair!r} is not KEY=VALUE")
            labels[key] = value
        check_labels(labels, lambda why: CsTorchError(f"ClusterConfig: job_labels: {why}"))
        return labels

    @classmethod
    def of(cls, value) -> "ClusterConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise CsTorchError(f"cluster_config: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
            return cls(**value)
        raise CsTorchError(f"cluster_config: expected a ClusterConfig or a dict, got {type(value).__name__}")


# What each setting does here, said once when it is not the default.
_UNHONOURED = {
    "max_wgt_servers": "MemoryX is one process per job here",
    "mount_dirs": "every process of the emulated cluster shares this machine's file system",
    "python_paths": "the input workers import from this process's sys.path",
    "job_priority": "no cluster scheduler priority here",
    "job_time_sec": "no cluster scheduler time limit here",
    "mgmt_namespace": "one namespace here",
    "credentials_path": "keys are made per job (docs/security.md)",
    "max_act_per_csx": "one activation server per WSE here",
}


class BackendType(str, enum.Enum):
    """The kinds of backend; equal to their names as strings ("CSX" == BackendType.CSX)."""
    CPU = "CPU"
    GPU = "GPU"
    CSX = "CSX"

    def __str__(self):
        return self.value

    @classmethod
    def from_str(cls, name: str) -> "BackendType":
        """The type of that name, in any case ("csx" is CSX)."""
        try:
            return cls(str(name).upper())
        except ValueError:
            raise ValueError(f"{name} backend not yet supported. Supported backends include: "
                             f"{', '.join(t.value for t in cls)}") from None

    @property
    def is_cpu(self) -> bool:
        return self is BackendType.CPU

    @property
    def is_gpu(self) -> bool:
        return self is BackendType.GPU

    @property
    def is_csx(self) -> bool:
        return self is BackendType.CSX


@dataclass
class Backend:
    backend_type: str
    artifact_dir: str
    compile_dir: str | None
    compile_only: bool
    validate_only: bool
    cluster_config: ClusterConfig
    retrace_every_iteration: bool = False
    # backend(..., mixed_precision=), as the model zoo passes it on CPU: True trains in the half
    # dtype (cstorch.amp), False in float32; the real CPU backend's default, False, on every type.
    mixed_precision: bool = False

    def __post_init__(self):
        self.backend_type = BackendType(self.backend_type)
        self.device = Device(self.backend_type)

    @property
    def is_csx(self) -> bool:
        return self.backend_type is BackendType.CSX

    @property
    def is_cpu(self) -> bool:
        return self.backend_type is BackendType.CPU

    @property
    def is_gpu(self) -> bool:
        return False        # backend("GPU") runs as CPU here

    @property
    def is_e2e_execution(self) -> bool:
        """Whether runs execute (not only compile or validate)."""
        return not (self.compile_only or self.validate_only)

    @property
    def is_tracing(self) -> bool:
        """Whether a traced step's code is running as a trace now (captured, or replayed on the step's
        values): its effects are recorded, not done, and its tensors are not values yet."""
        from .recording import probing, replaying
        return probing() is not None or replaying() is not None

    @property
    def _impl(self) -> "Backend":
        """The real API's backend object behind the handle: the same object here."""
        return self

    # The real backend's compile response (kernels' FLOPs): the emulator's compiler makes none.
    appliance = None

    @property
    def cluster(self) -> "Cluster":
        """A CSX backend's link to its cluster (the real API's backend.cluster)."""
        if not self.is_csx:
            raise AttributeError(f"a {self.backend_type.value} backend has no cluster")
        if "_cluster" not in self.__dict__:
            self.__dict__["_cluster"] = Cluster(self)
        return self.__dict__["_cluster"]


class Cluster:
    """backend.cluster: the CS system's settings and workflow. A workflow is the span over which the
    real cluster keeps a run's resources across its jobs; here each loop of a run is its own job of
    the emulated cluster (started for it), so a workflow is an id the run's jobs share and nothing
    is held between them. Telemetry the run pushes is kept (client.telemetry)."""

    def __init__(self, backend: "Backend"):
        self._backend = backend
        self.workflow_id: str | None = None
        self.client = types.SimpleNamespace(telemetry=[])

    @property
    def config(self) -> "ClusterConfig":
        return self._backend.cluster_config

    @config.setter
    def config(self, value) -> None:
        self._backend.cluster_config = ClusterConfig.of(value)

    def start_workflow(self, lock_resources: bool = True) -> bool:
        if self.workflow_id is None:
            self.workflow_id = f"wflow-{os.getpid()}"
        return True

    def stop_workflow(self) -> None:
        self.workflow_id = None

    def check_storage_connectivity(self) -> None:
        """Every process of the emulated cluster shares this machine's file system: nothing to check."""


class Device:
    """backend.device: the context the model is made in (`with backend.device: model = ...`; its
    parameters stay on the host here) and its settings (`device.config.lazy_initialization`,
    `drop_data`, which the model zoo sets and which change nothing here). Prints as its type."""

    def __init__(self, backend_type: "BackendType"):
        self.type = backend_type.value
        self.config = types.SimpleNamespace(lazy_initialization=True, drop_data=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __str__(self):
        return self.type


_current: Backend | None = None


def backend(backend_type: str = "CSX", *args, artifact_dir: str = "./cerebras", compile_dir: str | None = None,
            compile_only: bool = False, validate_only: bool = False, cluster_config=None,
            retrace_every_iteration: bool = False, **kwargs) -> Backend:
    """cstorch.backend(backend_type, artifact_dir=, compile_dir=, compile_only=, validate_only=,
    cluster_config=ClusterConfig(...)): the one backend of this process."""
    global _current
    if args:
        raise CsTorchError("backend: give the settings by name (backend('CSX', artifact_dir=...))")
    kind = str(backend_type).upper()
    if kind not in BACKEND_TYPES:
        raise CsTorchError(f"backend: backend_type must be one of {', '.join(BACKEND_TYPES)}, got {backend_type!r}")
    if kind == "GPU":
        note("backend('GPU'): no GPU here; runs as backend('CPU')")
        kind = "CPU"
    if _current is not None and _current.backend_type != kind:
        raise CsTorchError(f"backend: cannot instantiate multiple backends; a backend of type "
                           f"{_current.backend_type} already exists")
    if compile_only and validate_only:
        raise CsTorchError("backend: compile_only and validate_only are exclusive")
    mixed_precision = kwargs.pop("mixed_precision", False)
    config = ClusterConfig.of(cluster_config)
    for key in ("num_csx", "num_workers_per_csx", "max_wgt_servers", "mount_dirs", "mgmt_address"):
        if key in kwargs:   # flat spellings of earlier releases
            setattr(config, key, kwargs.pop(key))
    for key in sorted(k for k in kwargs if kwargs[k] is not None):   # None: the real API's default
        note(f"backend: argument {key}={kwargs[key]!r} is not honoured by the emulator")
    defaults = ClusterConfig()
    for key, why in _UNHONOURED.items():
        if getattr(config, key) != getattr(defaults, key):
            note(f"cluster_config.{key}={getattr(config, key)!r} is not honoured: {why}")
    if retrace_every_iteration:
        note("backend: retrace_every_iteration is not honoured: a traced step is captured once")
    _current = Backend(kind, str(artifact_dir), compile_dir, bool(compile_only), bool(validate_only), config,
                       bool(retrace_every_iteration),
                       bool(mixed_precision))
    return _current


def current_backend() -> Backend:
    """The backend of this process; a CPU one if none was made (as on a machine without a CS system)."""
    global _current
    if _current is None:
        _current = Backend("CPU", "./cerebras", None, False, False, ClusterConfig())
    return _current


def cluster_config_in_use() -> ClusterConfig:
    """The backend's cluster settings, the defaults before one is made; asking makes no backend (the model
    zoo asks for the job's tasks while it sets up logging, before it makes its CSX backend)."""
    return _current.cluster_config if _current is not None else ClusterConfig()


def use_cs() -> bool:
    """Whether this process runs on the CS system (its backend is CSX); asking makes no backend."""
    return _current is not None and _current.is_csx


def current_torch_device():
    """The torch device of the backend's tensors: the host's, on every backend here."""
    import torch
    return torch.device("cpu")


def current_backend_impl(raise_exception: bool = True) -> Backend | None:
    """The real API's name for the backend in use (cstorch.backend.current_backend_impl). With
    raise_exception=False, None while no backend is made (the model zoo's trainer asks so before it
    makes one); otherwise the backend, a CPU one if none was made (current_backend)."""
    if not raise_exception and _current is None:
        return None
    return current_backend()


def reset_backend() -> None:
    """Forget the backend (tests; a new script run)."""
    global _current
    _current = None
