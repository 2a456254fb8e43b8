"""dataloader(input_fn, batch_size): batches made by the job's input workers.

    def train_input_fn():                 # top level of the script or of a module
        return load_mnist(None, "train")  # (x, y) arrays, or an object with __len__ and get(indices)

    loader = cs_torch.dataloader(train_input_fn, batch_size=64)
    for batch in loader:                  # one pass over the data set, as a PyTorch DataLoader
        loss = session.step(batch)

As on a real CS system, the input function does not run in your process: the
Session starts input workers (`python -m cs_torch.input_worker`) that import
it by name, build the same global batches as csrun_wse's workers (a pure
function of the step: `cs_runtime.data.batches.BatchPlan`) and stream each WSE its
rows. What the loop gets is a `Batch` handle that says which loader it comes
from; the data goes from the workers to the WSEs, never through your process.

The constraint that follows: `input_fn` must be a function defined at the
top level of a module or of your script, and the script must keep its
training loop under `if __name__ == "__main__":` (a worker imports the
script, which runs its top-level code). Its arguments (`*args`, `**kwargs`)
must be JSON values (strings, numbers, lists, dicts, None), since they
travel to the workers as JSON, never pickled.
"""
from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cs_runtime import env
from cs_runtime.data.inputs import dataset_len

from .nn import CsTorchError

INPUT_ENV = env.TORCH_INPUT.name  # the input workers' instructions (JSON), see cs_torch/input_worker.py


@dataclass(frozen=True)
class Batch:
    """One global batch of `loader`, made by the input workers; pass it to `Session.step`."""
    loader: "DataLoader"
    index: int  # within this iteration of the loader


class DataLoader:
    def __init__(self, input_fn, batch_size: int, *args, shuffle: bool = True, drop_last: bool = True,
                 shuffle_seed: int | None = None, num_steps: int | None = None, **kwargs):
        for name, value in (("batch_size", batch_size), ("num_steps", num_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CsTorchError(f"dataloader: {name} must be a positive integer, got {value!r}")
        self.input_fn, self.args, self.kwargs = input_fn, list(args), dict(kwargs)
        self.batch_size, self.shuffle, self.drop_last = batch_size, bool(shuffle), bool(drop_last)
        self.shuffle_seed, self.num_steps = shuffle_seed, num_steps
        self.location = function_location(input_fn)
        try:
            json.dumps([self.args, self.kwargs])
        except (TypeError, ValueError) as exc:
            raise CsTorchError(f"dataloader: the arguments of {input_fn.__name__} must be JSON values "
                               f"(they travel to the input workers): {exc}") from None
        self._num_samples: int | None = None

    def dataset(self):
        """The input function's data set, built here (the workers build their own)."""
        return self.input_fn(*self.args, **self.kwargs)

    @property
    def num_samples(self) -> int:
        if self._num_samples is None:
            self._num_samples = dataset_len(self.dataset())
        return self._num_samples

    def __len__(self) -> int:
        """Batches per pass over the data set (num_steps when given)."""
        if self.num_steps is not None:
            return self.num_steps
        n = self.num_samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        return (Batch(self, i) for i in range(len(self)))

    def section(self) -> dict:
        """The train_input / eval_input section of the params the workers use."""
        return {"batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last_batch": self.drop_last,
                "shuffle_seed": self.shuffle_seed}

    def worker_spec(self) -> dict:
        """What an input worker needs to build the same data set (JSON)."""
        return {**self.location, "args": self.args, "kwargs": self.kwargs}


def function_location(fn) -> dict:
    """{"module", "file", "function"} by which an input worker can import `fn`, or a one-line error.
    A function defined inside another (`outer.<locals>.inner`, as the model zoo's trainer makes its
    input function) is rebuilt there from the outer function's code and the values it captured, each
    named ("closure": {variable: {"name": "module:qualname"}} for a class or function a worker can
    import) or a JSON value ({"value": ...}); anything else is refused in one line."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or not name or not module:
        raise CsTorchError(f"dataloader: input_fn must be a function, got {type(fn).__name__}")
    nested = name.count(".<locals>.") == 1 and "<" not in name.replace(".<locals>.", "") and \
        "." not in name.split(".<locals>.")[0]
    if ("<" in name or "." in name) and not nested:
        raise CsTorchError(f"dataloader: input_fn {name} must be defined at the top level of a module or "
                           "script, or directly inside a top-level function (the input workers import it by name)")
    file = getattr(sys.modules.get(module), "__file__", None)
    if module == "__main__" and not file:
        raise CsTorchError(f"dataloader: input_fn {name} is defined in an interactive session; define it "
                           "in a file (the input workers import it by name)")
    location = {"module": module, "file": str(Path(file).resolve()) if file else None, "function": name}
    if nested:
        location["closure"] = _captured(fn)
    return location


CONFIG_KEY = "__config__"


def travelling(value):
    """An input function's argument as JSON for the input workers: a config object (a pydantic model:
    model_dump / model_validate, as the model zoo's data processors take) as its class's name and its
    fields; other values as they are (they must be JSON)."""
    if isinstance(value, dict):
        return {k: travelling(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [travelling(v) for v in value]
    cls = type(value)
    if callable(getattr(value, "model_dump", None)) and callable(getattr(cls, "model_validate", None)) and \
            "<" not in cls.__qualname__:
        return {CONFIG_KEY: f"{cls.__module__}:{cls.__qualname__}", "fields": value.model_dump(mode="json")}
    return value


def arrived(value):
    """travelling's value rebuilt in an input worker (a config validated again by its class)."""
    if isinstance(value, dict) and CONFIG_KEY in value:
        module, _, qualname = value[CONFIG_KEY].partition(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls.model_validate(value["fields"])
    if isinstance(value, dict):
        return {k: arrived(v) for k, v in value.items()}
    if isinstance(value, list):
        return [arrived(v) for v in value]
    return value


def _captured(fn) -> dict:
    """What a nested input function captured, each value named or JSON (see function_location)."""
    if fn.__defaults__ or fn.__kwdefaults__:
        raise CsTorchError(f"dataloader: input_fn {fn.__qualname__} has default arguments; the input workers "
                           "rebuild a nested function from its captured values only")
    captured = {}
    for variable, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = cell.cell_contents
        owner, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if callable(value) and owner and qualname and "<" not in qualname:   # a class or function by name
            captured[variable] = {"name": f"{owner}:{qualname}"}
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise CsTorchError(f"dataloader: input_fn {fn.__qualname__} captures {variable} "
                               f"({type(value).__name__}): the input workers get only JSON values and "
                               "classes or functions they can import") from None
        captured[variable] = {"value": value}
    return captured
