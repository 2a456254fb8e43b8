"""cstorch.backends.csx: the CS system's settings, as the real API groups them.

    cstorch.backends.csx.precision.optimization_level = 1     # POL 0, 1 or 2
    cstorch.backends.csx.debug.ini.ws_opt_foo = True
    cstorch.backends.csx.debug.debug_args.MergeFrom(debug_args)
    cstorch.backends.csx.performance.micro_batch_size = "auto"
    cstorch.backends.csx.cluster.auto_taint = True

They are kept and read back. The one a model reads to choose its math is the
precision optimisation level (the model zoo's GPT-2 keeps its attention softmax
in float32 unless POL is 2): checked to be 0, 1 or 2. The emulated kernels
compute as level 0 does whatever the level (cs_torch/core/pol.py); the others
change nothing here (the emulated cluster takes its settings from run.py's flags
and the params file).
"""
from __future__ import annotations

DEFAULT_POL = 1     # the real API's default optimisation level of a CSX backend


class Settings:
    """A group of settings: any attribute may be set, read back and deleted; one never set reads as a
    group of its own (debug_args.debug_usr.x = 1)."""

    def __init__(self, **values):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._values.setdefault(name, Settings())

    def __setattr__(self, name: str, value) -> None:
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        if name not in self._values:
            raise AttributeError(name)
        del self._values[name]

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, Settings) else v for k, v in self._values.items()}

    def MergeFrom(self, other) -> None:  # noqa: N802 (the protobuf spelling the model zoo calls)
        """Take every value `other` holds (another group, a dict, or debug args with to_dict)."""
        values = other if isinstance(other, dict) else other.to_dict()
        for key, value in values.items():
            if isinstance(value, dict):
                getattr(self, key).MergeFrom(value)
            else:
                setattr(self, key, value)


class _Precision(Settings):
    def __setattr__(self, name: str, value) -> None:
        if name == "optimization_level" and value not in (0, 1, 2):
            raise ValueError(f"cstorch.backends.csx.precision.optimization_level must be 0, 1 or 2, got {value!r}")
        super().__setattr__(name, value)


csx = Settings(
    precision=_Precision(optimization_level=DEFAULT_POL),
    debug=Settings(debug_args=Settings(), ini=Settings(), fabric_type_blacklist=None, lazy_initialization=True,
                   retrace_every_iteration=False),
    performance=Settings(micro_batch_size="auto", transfer_processes=None),
    cluster=Settings(auto_taint=False),
    storage=Settings(s3=Settings(profile=None)),
)
