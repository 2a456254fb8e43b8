"""A compiled program as data: named parameters, named inputs, constants and
nodes over the op set of ops.py.

    program = Program(params={"fc1.weight": Value((64, 784), "float32"), ...},
                      inputs={"x": Value((32, 784), "float32"), "y": Value((32,), "int64")},
                      consts={}, nodes=[Node("linear", ("x", "fc1.weight", "fc1.bias"), ("fc1",),
                                              {}, module="fc1", source="run.py:12"), ...],
                      outputs={"loss": "loss"})

A buffer (BatchNorm's running statistics and count) is a parameter that
takes no gradient: outputs["buffer:<name>"] names the value a train step
leaves in it (`buffers()`), which the run carries to the next step.

Every value has one name; a node names its inputs and its outputs (a
forward op has one output; a backward `vjp` node one per gradient, "" where
an input gets none). `module` is the torch module path the op came from and
`source` its line in the user's code, for error messages and the report.

The IR lives in numerics, not in the compiler, because the WSE and the CPU
path run it (executor.py) and a program-backed layer (model.py) carries it:
the layers below the compiler must be able to read it. to_meta/from_meta
turn it into plain msgpack-able data (constants as raw bytes with dtype and
shape) and back, validating everything, so it crosses the wire as data and
never as code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cs_runtime.errors import CsError
from cs_runtime.numerics.ops import OPS

DTYPES = ("float32", "float64", "int64", "int32", "bool")
META_VERSION = 1
MAX_NODES = 1 << 16
MAX_CONST_BYTES = 64 << 20
BACKWARD_OPS = ("vjp",)      # a node of the backward program: the vjp rule of the forward op in attrs["of"]
BUFFER_ROLE = "buffer:"      # outputs[BUFFER_ROLE + p]: the value a train step leaves in buffer p


class ProgramError(CsError, ValueError):
    """A program (or its wire form) is malformed; the message says where."""


@dataclass(frozen=True)
class Value:
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict = field(default_factory=dict, hash=False, compare=False)
    module: str = ""
    source: str = ""

    def where(self) -> str:
        """Module path, op and source line, for one-line messages."""
        return f"module {self.module or '<root>'}, op {self.op}" + (f", at {self.source}" if self.source else "")


@dataclass
class Program:
    params: dict[str, Value]
    inputs: dict[str, Value]
    consts: dict[str, np.ndarray]
    nodes: list[Node]
    outputs: dict[str, str]           # role ("loss", ...) -> value name

    def buffers(self) -> dict[str, str]:
        """{buffer (a parameter without gradient): the value a train step leaves in it}."""
        return buffer_updates(self.outputs)

    def value_names(self) -> set[str]:
        names = set(self.params) | set(self.inputs) | set(self.consts)
        for node in self.nodes:
            names.update(o for o in node.outputs if o)
        return names

    def validate(self) -> "Program":
        """Ops known, every input defined before use, every name defined once."""
        defined = set(self.params) | set(self.inputs) | set(self.consts)
        if len(defined) != len(self.params) + len(self.inputs) + len(self.consts):
            raise ProgramError("a name is both a parameter, an input or a constant")
        for value in (*self.params.values(), *self.inputs.values()):
            if value.dtype not in DTYPES:
                raise ProgramError(f"dtype {value.dtype!r} not one of {DTYPES}")
        for i, node in enumerate(self.nodes):
            if node.op not in OPS and node.op not in BACKWARD_OPS:
                raise ProgramError(f"node {i}: unknown op {node.op!r} ({node.where()})")
            if node.op == "vjp" and node.attrs.get("of") not in OPS:
                raise ProgramError(f"node {i}: vjp of unknown op {node.attrs.get('of')!r}")
            if _residual_problem(node):
                raise ProgramError(f"node {i} ({node.where()}): {_residual_problem(node)}")
            for name in node.inputs:
                if name and name not in defined:
                    raise ProgramError(f"node {i} ({node.where()}) reads {name!r} before it is defined")
            for name in node.outputs:
                if name in defined:
                    raise ProgramError(f"node {i} ({node.where()}) redefines {name!r}")
                if name:
                    defined.add(name)
        for role, name in self.outputs.items():
            if name not in defined:
                raise ProgramError(f"output {role!r} names {name!r}, which no node defines")
        for buffer in self.buffers():
            if buffer not in self.params:
                raise ProgramError(f"output {BUFFER_ROLE}{buffer} names no parameter")
        return self

    # ------------------------------------------------------------ wire form

    def to_meta(self) -> dict:
        return {
            "version": META_VERSION,
            "params": {k: [list(v.shape), v.dtype] for k, v in self.params.items()},
            "inputs": {k: [list(v.shape), v.dtype] for k, v in self.inputs.items()},
            "consts": {k: [list(a.shape), str(a.dtype), np.ascontiguousarray(a).tobytes()]
                       for k, a in self.consts.items()},
            "nodes": [[n.op, list(n.inputs), list(n.outputs), _plain(n.attrs), n.module, n.source]
                      for n in self.nodes],
            "outputs": dict(self.outputs),
        }

    @classmethod
    def from_meta(cls, meta) -> "Program":
        if not isinstance(meta, dict) or meta.get("version") != META_VERSION:
            raise ProgramError(f"program meta: expected a dict of version {META_VERSION}")
        try:
            params = {_name(k): _value(v) for k, v in meta["params"].items()}
            inputs = {_name(k): _value(v) for k, v in meta["inputs"].items()}
            consts = {_name(k): _const(v) for k, v in meta["consts"].items()}
            raw = meta["nodes"]
            if not isinstance(raw, list) or len(raw) > MAX_NODES:
                raise ProgramError(f"program meta: nodes must be a list of at most {MAX_NODES}")
            nodes = [_node(n) for n in raw]
            outputs = {_name(k): _name(v) for k, v in meta["outputs"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ProgramError):
                raise
            raise ProgramError(f"program meta is malformed: {exc}") from None
        return cls(params, inputs, consts, nodes, outputs).validate()


def buffer_updates(outputs: dict) -> dict[str, str]:
    """A program's outputs (Program.outputs) -> {buffer: the value a train step leaves in it}."""
    return {role[len(BUFFER_ROLE):]: value for role, value in outputs.items() if role.startswith(BUFFER_ROLE)}


def _plain(attrs: dict) -> dict:
    """Attributes as msgpack-able data: tuples become lists, numpy scalars Python ones."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v
    return {k: plain(v) for k, v in attrs.items()}


def _name(v) -> str:
    if not isinstance(v, str) or len(v) > 512:
        raise ProgramError(f"program meta: expected a name (str), got {type(v).__name__}")
    return v


def _value(v) -> Value:
    shape, dtype = v
    if dtype not in DTYPES or not all(isinstance(d, int) and 0 <= d < 1 << 31 for d in shape):
        raise ProgramError(f"program meta: bad value {v!r}")
    return Value(tuple(shape), dtype)


def _const(v) -> np.ndarray:
    shape, dtype, data = v
    value = _value([shape, dtype])
    if not isinstance(data, bytes) or len(data) > MAX_CONST_BYTES:
        raise ProgramError("program meta: a constant's data must be bytes under the size cap")
    count = int(np.prod(value.shape, dtype=np.int64))
    if len(data) != count * np.dtype(dtype).itemsize:
        raise ProgramError(f"program meta: constant of shape {value.shape} {dtype} has {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(value.shape).copy()


_ATTR_TYPES = (int, float, str, bool, type(None))


def _attr_ok(v, depth=0) -> bool:
    if isinstance(v, list):
        return depth < 3 and len(v) <= 64 and all(_attr_ok(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return depth < 3 and len(v) <= 64 and all(isinstance(k, str) and _attr_ok(x, depth + 1)
                                                  for k, x in v.items())
    return isinstance(v, _ATTR_TYPES)


def _node(n) -> Node:
    op, inputs, outputs, attrs, module, source = n
    if not isinstance(attrs, dict) or not _attr_ok(attrs):
        raise ProgramError(f"program meta: attributes of a {op!r} node are not plain data")
    return Node(_name(op), tuple(_name(i) for i in inputs), tuple(_name(o) for o in outputs), attrs,
                _name(module), _name(source))


@dataclass
class Unit:
    """One weight-streaming unit of a program (built by cs_runtime/compiler/units.py).

    `reads` are the values it takes from before it (activations of earlier
    units, program inputs, constants), `writes` the values later units or the
    program's outputs take from it; `params` the parameters it reads (a tied
    parameter appears in every unit that reads it). `backward` takes
    "d:<v>" for each v in `grad_writes` and produces `param_grads[p]` for each
    parameter and `input_grads[v]` for each value in `grad_reads`."""
    name: str
    params: tuple[str, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    forward: list[Node]
    backward: list[Node]
    grad_writes: tuple[str, ...]
    grad_reads: tuple[str, ...]
    param_grads: dict[str, str]
    input_grads: dict[str, str]
    kept: tuple[str, ...]            # forward values the backward reads (held between the passes)
    shape_only: tuple[str, ...] = ()  # forward values whose shape alone the backward needs

    def to_meta(self) -> dict:
        nodes = lambda ns: [[n.op, list(n.inputs), list(n.outputs), _plain(n.attrs), n.module, n.source]  # noqa
                            for n in ns]
        return {"name": self.name, "params": list(self.params), "reads": list(self.reads),
                "writes": list(self.writes), "forward": nodes(self.forward), "backward": nodes(self.backward),
                "grad_writes": list(self.grad_writes), "grad_reads": list(self.grad_reads),
                "param_grads": dict(self.param_grads), "input_grads": dict(self.input_grads),
                "kept": list(self.kept), "shape_only": list(self.shape_only)}

    @classmethod
    def from_meta(cls, m) -> "Unit":
        try:
            names = lambda key: tuple(_name(x) for x in m[key])  # noqa: E731
            mapping = lambda key: {_name(k): _name(v) for k, v in m[key].items()}  # noqa: E731
            unit = cls(_name(m["name"]), names("params"), names("reads"), names("writes"),
                       [_node(n) for n in m["forward"]], [_node(n) for n in m["backward"]],
                       names("grad_writes"), names("grad_reads"), mapping("param_grads"),
                       mapping("input_grads"), names("kept"), names("shape_only"))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ProgramError):
                raise
            raise ProgramError(f"unit meta is malformed: {exc}") from None
        unit.validate()
        return unit

    def validate(self) -> None:
        """Every node's inputs defined inside the unit, from its reads or its parameters."""
        defined = set(self.params) | set(self.reads)
        for node in self.forward:
            _check_node(node, defined, self.name)
        forward_values = set(defined)
        defined |= {f"d:{v}" for v in self.grad_writes}
        for node in self.backward:
            _check_node(node, defined, self.name)
        for value in (*self.writes, *self.kept, *self.shape_only):
            if value not in forward_values:
                raise ProgramError(f"unit {self.name}: {value!r} is not a value of its forward")
        for produced in (*self.param_grads.values(), *self.input_grads.values()):
            if produced not in defined:
                raise ProgramError(f"unit {self.name}: {produced!r} is never defined")


def _check_node(node: Node, defined: set, unit: str) -> None:
    if node.op not in OPS and not (node.op == "vjp" and node.attrs.get("of") in OPS):
        raise ProgramError(f"unit {unit}: unknown op {node.op!r} ({node.where()})")
    problem = _residual_problem(node)
    if problem:
        raise ProgramError(f"unit {unit}: {node.where()}: {problem}")
    for name in node.inputs:
        if name and name not in defined:
            raise ProgramError(f"unit {unit}: {node.where()} reads {name!r}, not defined before it")
    defined.update(o for o in node.outputs if o)


def _residual_problem(node: Node) -> str:
    """Why a node's residual (a forward's second output, a vjp's residual flag) cannot be,
    or "": only an op that makes one (Op.residual) may have it."""
    if node.op == "vjp":
        return "" if not node.attrs.get("residual") or OPS[node.attrs["of"]].residual_vjp else \
            f"the vjp of {node.attrs['of']} takes no residual"
    if len(node.outputs) == 1 or (len(node.outputs) == 2 and OPS[node.op].residual and all(node.outputs)):
        return ""
    return f"{len(node.outputs)} outputs; the op makes one" + (" and its residual" if OPS[node.op].residual else "")


# Ops whose output is a mask, whatever their inputs
BOOL_OUT = frozenset({"compare", "logical_not", "logical_and", "logical_or", "logical_xor", "isnan", "isinf", "any"})


def _out_dtype(node: Node, dtypes: dict[str, str]) -> str:
    if node.op in BOOL_OUT:
        return "bool"
    if node.op in ("argmax", "argmin", "topk_indices"):
        return "int64"
    if node.op in ("cast", "full_like", "draw"):
        return node.attrs["dtype"]
    if node.op == "softmax_cross_entropy":
        return "float64"   # the loss as the runner reports it
    ins = [dtypes[i] for i in node.inputs]
    return next((d for d in ins if d.startswith("float")), ins[0] if ins else "float32")


def infer_values(program: Program) -> tuple[dict[str, tuple], dict[str, str]]:
    """Shape and dtype of every forward value, by the ops' shape rules; a rule
    that fails raises ProgramError naming the module path, the op and the line."""
    from cs_runtime.numerics.ops import OpError
    shapes = {k: v.shape for k, v in (*program.params.items(), *program.inputs.items())}
    dtypes = {k: v.dtype for k, v in (*program.params.items(), *program.inputs.items())}
    for k, a in program.consts.items():
        shapes[k], dtypes[k] = a.shape, str(a.dtype)
    for node in program.nodes:
        try:
            shape = OPS[node.op].shape([shapes[i] for i in node.inputs], node.attrs)
        except (OpError, KeyError, IndexError, TypeError) as exc:
            raise ProgramError(f"{node.where()}: {exc}") from None
        shapes[node.outputs[0]] = tuple(int(d) for d in shape)
        dtypes[node.outputs[0]] = _out_dtype(node, dtypes)
    return shapes, dtypes
