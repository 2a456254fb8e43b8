"""The compiled artifact: model_dir/compile/artifact.json, reused while its key holds.

The key is the sha256 of everything that decides the compile's output: the
model, the params that affect compilation, the run mode, the target and the
compiler's own version. The artifact stores those inputs next to the key, so
when the key changes we can say which input did.

An artifact is JSON (never pickle: reading one must not run code) and is
checked before use: its format tag, its version, a checksum of its body, its
key against its stored inputs, and the shape of its plan. Anything wrong is
an `ArtifactError`, and the caller recompiles.

    inputs = compile_inputs(spec, params, "train", target)
    art = load(compile_dir)                    # None, or raises ArtifactError
    if art and art.key == key_of(inputs): ...  # reuse art.plan
    save(compile_dir, inputs, plan)
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cs_runtime.errors import CsError
from cs_runtime.config import Params
from cs_runtime.numerics.model import ModelSpec

from .planner import STRATEGIES, Target

FORMAT = "cs-emulator-compile-artifact"
VERSION = 1
# Bump when the compiler's output for the same inputs changes, so old
# artifacts are recompiled rather than trusted.
COMPILER_VERSION = "3"
FILENAME = "artifact.json"


class ArtifactError(CsError):
    """An artifact that cannot be trusted; the message says why."""


@dataclass
class Artifact:
    key: str
    inputs: dict[str, Any]
    plan: dict[str, Any]


def _digest(o: Any) -> str:
    """A captured program's binary data (constants) as the key sees it: its digest."""
    if isinstance(o, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(bytes(o)).hexdigest()
    raise TypeError(f"{type(o).__name__} is not part of a compile key")


def _canonical(obj: Any, allow_nan: bool = False) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=allow_nan, default=_digest).encode()


def _sha256(obj: Any, allow_nan: bool = False) -> str:
    return hashlib.sha256(_canonical(obj, allow_nan)).hexdigest()


def compile_params(params: Params) -> dict[str, Any]:
    """The params that change the compiled program (not learning rate, steps, logging)."""
    opt = params.optimizer
    return {
        "train_input.batch_size": params.train_input.batch_size,
        "eval_input.batch_size": params.eval_input.batch_size,
        # Optimizer state lives on the wafer in pipelined mode: it sizes the plan.
        "optimizer.optimizer_type": opt.optimizer_type,
        "optimizer.momentum": opt.momentum,
        "runconfig.execution_strategy": params.runconfig.execution_strategy,
        "csconfig": params.csconfig.to_dict(),
    }


def model_input(spec: ModelSpec) -> dict[str, Any]:
    """A built-in model as params.yaml describes it; a captured program by its name and digest
    (its units and constants are large, binary, and may hold -inf: a mask's fill value)."""
    model = spec.plain().to_dict()
    return {"name": spec.name, "program_sha256": _sha256(model, allow_nan=True)} if spec.captured else model


def compile_inputs(spec: ModelSpec, params: Params, mode: str, target: Target) -> dict[str, Any]:
    return {"compiler": COMPILER_VERSION, "model": model_input(spec), "params": compile_params(params),
            "mode": mode, "target": target.key_fields()}


def key_of(inputs: dict[str, Any]) -> str:
    return _sha256(inputs)


def changed_inputs(old: Any, new: Any, path: str = "") -> list[str]:
    """'params.csconfig.wafer_memory_bytes: None -> 1000' for every leaf that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{k}" if path else str(k)
            out += changed_inputs(old.get(k), new.get(k), sub)
        return out
    if isinstance(old, list) and isinstance(new, list):
        out = [c for i, (a, b) in enumerate(zip(old, new)) for c in changed_inputs(a, b, f"{path}[{i}]")]
        if len(old) != len(new):
            out.append(f"{path}: {len(old)} items -> {len(new)} items")
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


# ---------------------------------------------------------------- disk

def save(compile_dir: str | os.PathLike[str], inputs: dict[str, Any], plan: dict[str, Any]) -> Path:
    body = {"inputs": inputs, "plan": plan}
    doc = {"format": FORMAT, "version": VERSION, "key": key_of(inputs), "checksum": _sha256(body), **body}
    path = Path(compile_dir) / FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
    tmp.write_bytes(json.dumps(doc, indent=1, allow_nan=False).encode())
    os.replace(tmp, path)  # atomic: a crash leaves the old artifact or the new one
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{path}: corrupt, not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ArtifactError(f"{path}: not a compile artifact of this emulator (format {found!r})")
    if doc.get("version") != VERSION:
        raise ArtifactError(f"{path}: artifact version {doc.get('version')!r}, this compiler reads {VERSION}")
    return doc


def _check(path: Path, doc: dict[str, Any]) -> Artifact:
    body = {k: doc.get(k) for k in ("inputs", "plan")}
    if doc.get("checksum") != _sha256(body):
        raise ArtifactError(f"{path}: checksum does not match the contents (corrupt or edited)")
    if doc.get("key") != key_of(body["inputs"]):
        raise ArtifactError(f"{path}: key does not match the stored inputs (corrupt or edited)")
    plan = body["plan"]
    if not isinstance(plan, dict) or plan.get("execution_strategy") not in STRATEGIES \
            or not isinstance(plan.get("kernels"), list):
        raise ArtifactError(f"{path}: the stored plan is malformed")
    return Artifact(doc["key"], body["inputs"], plan)


def load(compile_dir: str | os.PathLike[str]) -> Artifact | None:
    """The artifact in `compile_dir`, None if there is none, ArtifactError if it is bad."""
    path = Path(compile_dir) / FILENAME
    if not path.exists():
        return None
    return _check(path, _read(path))
