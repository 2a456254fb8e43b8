"""Imports point down the layers and close no cycle.

Every .py file of the packages is read with `ast` (nothing is imported), and
every import in it, at module level or inside a function, is an edge from its
module to the project module it names. An edge is wrong when it goes up a
layer, when it joins two roles (separate processes that share code only
through the layers below them), or when it closes a cycle among the rest.
KNOWN_VIOLATIONS lists the wrong edges that are still there, each with why;
the test fails on a wrong edge not listed and on a listed edge that is gone,
so the list only ever shrinks.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster_utils import REPO

PACKAGES = ("cs_runtime", "chief", "worker", "wse", "cs_torch", "scripts", "examples", "cerebras_pytorch",
            "cerebras_appliance", "cerebras")

# Bottom first. A module may import modules of its own layer and of the layers
# below; which unit a module belongs to is its longest matching name prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    # What any process needs before it talks to anyone: params, the CS_*
    # variables, flag spelling, the span recorder (the kernels record spans),
    # the maths, the data sets, running the user's script as a role, the probes'
    # output line. `cs_runtime` itself is the package's __init__.
    ("cs_runtime", "cs_runtime.errors", "cs_runtime.env", "cs_runtime.flags", "cs_runtime.spans",
     "cs_runtime.user_script", "cs_runtime.probe_line", "cs_runtime.torch_names", "cs_runtime.roles",
     "cs_runtime.import_names", "cs_runtime.units",
     # what the data sets and the maths agree on: counter-based draws, the ignored label, the
     # language models' feature names
     "cs_runtime.numerics.hashing", "cs_runtime.numerics.batch_check", "cs_runtime.numerics.transformer_params"),
    # The data sets: below the maths, which they never reach into.
    ("cs_runtime.data",),
    # The maths, and params.yaml (whose learning rule is the maths' OptimizerSpec).
    ("cs_runtime.numerics", "cs_runtime.config", "cs_runtime.lm_checks"),
    # Bytes between processes: the protocol, transport, shared memory, keys.
    ("cs_runtime.wire",),
    # What a process of any role uses: sending its timeline, checkpoints, the
    # compiler, the arguments every role is handed (run_args).
    ("cs_runtime.trace", "cs_runtime.checkpoint", "cs_runtime.checkpoint_mdl", "cs_runtime.compiler",
     "cs_runtime.run_args", "cs_runtime.run_lock"),
    # A process of a job: its identity from the environment and its logging (service), leaving
    # when its launcher dies (orphan), and its side of the job's directory (registration,
    # lookups, heartbeats). Below both the roles and the launcher, so neither reaches into
    # the other for it.
    ("cs_runtime.process",),
    # The roles, each a process of its own: MemoryX, SwarmX, the WSE, and those that run the
    # user's script (the chief, the input workers).
    ("cs_runtime.memoryx", "cs_runtime.swarmx", "chief", "worker", "wse"),
    # Starting a job: the launcher, its directory and back-ends, the front door's client. It
    # starts the roles by module name (roles.py) and imports none of them.
    ("cs_runtime.launch",),
    # The shared CS system: a long-lived server that starts jobs' services with the launcher's
    # process groups and directory.
    ("cs_runtime.appliance",),
    # The entry point a model's run.py calls (runner: it hands over to the role
    # CS_ROLE names, importing it by name) and the torch front end's base: its
    # modules and errors, the backend, and what the step in progress is doing
    # (recording: read by everything that records into a traced step).
    ("cs_runtime.runner", "cs_torch.nn", "cs_torch.backends", "cs_torch.csx_settings", "cs_torch.recording",
     "cs_torch.distributed"),
    # The torch front end's rules a step applies: optimizers and their update
    # rules, schedulers, the loss scaler, summaries.
    ("cs_torch.optim", "cs_torch.optim_params", "cs_torch.optimizers", "cs_torch.optim_configure",
     "cs_torch.lr_scheduler", "cs_torch.amp",
     "cs_torch.summary", "cs_torch.scheduler", "cs_torch.weight_decay_scheduler"),
    # The rest of the torch front end: the tracer, the session, the cluster
    # step and the DataExecutor that drives them.
    ("cs_torch",),
    # The vendor's import names the model zoo uses, served by the packages above
    # (cs_runtime.import_names): cerebras_pytorch and cerebras.pytorch are cs_torch;
    # cerebras_appliance (also cerebras.appliance) is the appliance client's helpers.
    ("cerebras_pytorch", "cerebras", "cerebras_appliance"),
    # Command lines (the installed ones in cs_runtime.cli, the development tools in scripts) and the
    # user's code: nothing below imports them.
    ("cs_runtime.cli", "scripts", "examples"),
)

# Separate processes: they share code only through the layers below them.
ROLES = frozenset({"cs_runtime.memoryx", "cs_runtime.swarmx", "chief", "worker", "wse"})

# (importer, imported) -> why it is still there. Delete an entry with the edge.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    source: str   # importing module
    target: str   # imported project module
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "function-level import" if self.in_function else "import"
        return f"{self.source} -> {self.target} ({where}, line {self.line})"


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_names(module: str, path: Path, tree: ast.AST):
    """(dotted name, node) for every import; `from a import b` gives a.b (b may be a module)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot past the first
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            yield from ((f"{base}.{alias.name}", node) for alias in node.names)


def nodes_in_functions(tree: ast.AST) -> set[int]:
    inside = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(func) if n is not func)
    return inside


def import_edges(root: Path, packages: tuple[str, ...]) -> tuple[dict[str, Path], list[Edge]]:
    files = module_files(root, packages)
    edges = set()
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        inside = nodes_in_functions(tree)
        for name, node in imported_names(module, path, tree):
            while name and name not in files:  # a.b.func -> a.b; third-party names -> ""
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(Edge(module, name, node.lineno, id(node) in inside))
    return files, sorted(edges, key=lambda e: (e.source, e.target, e.line))


def unit_of(module: str, layers) -> str | None:
    units = [u for layer in layers for u in layer if module == u or module.startswith(u + ".")]
    return max(units, key=len, default=None)


def layer_of(module: str, layers) -> int:
    unit = unit_of(module, layers)
    return next(i for i, layer in enumerate(layers) if unit in layer)


def cycle_members(edges: list[Edge]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(edges: list[Edge], layers, roles) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> why each of its imports is wrong."""
    wrong: dict[tuple[str, str], list[str]] = {}
    rest = []
    for e in edges:
        source_unit, target_unit = unit_of(e.source, layers), unit_of(e.target, layers)
        if layer_of(e.target, layers) > layer_of(e.source, layers):
            wrong.setdefault((e.source, e.target), []).append(f"{e} goes up from {source_unit} to {target_unit}")
        elif source_unit != target_unit and source_unit in roles and target_unit in roles:
            wrong.setdefault((e.source, e.target), []).append(f"{e} joins the roles {source_unit} and {target_unit}")
        else:
            rest.append(e)
    for members in cycle_members(rest):
        for e in rest:
            if e.source in members and e.target in members:
                wrong.setdefault((e.source, e.target), []).append(
                    f"{e} closes a cycle among {', '.join(sorted(members))}")
    return wrong


@pytest.fixture(scope="module")
def project():
    return import_edges(REPO, PACKAGES)


def test_every_module_sits_in_a_layer(project):
    files, _ = project
    assert len(files) > 50  # the packages were found
    homeless = [m for m in files if unit_of(m, LAYERS) is None]
    assert not homeless, f"modules in no layer (add their package to LAYERS): {homeless}"


def test_imports_point_down_and_close_no_cycle(project):
    files, edges = project
    assert any(e.in_function for e in edges)  # function-level imports are read too
    new = {k: v for k, v in violations(edges, LAYERS, ROLES).items() if k not in KNOWN_VIOLATIONS}
    assert not new, "imports against the layering (tests/test_layers.py LAYERS):\n" + "\n".join(
        line for lines in new.values() for line in lines)


def test_known_violations_are_all_still_there(project):
    _, edges = project
    gone = set(KNOWN_VIOLATIONS) - set(violations(edges, LAYERS, ROLES))
    assert not gone, f"fixed, so delete from KNOWN_VIOLATIONS: {sorted(gone)}"


def test_the_check_finds_up_imports_cycles_and_role_joins(tmp_path):
    tree = {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from high.b import g\n",          # up, inside a function
        "low/c.py": "from . import d\n",                              # relative, cycle with d
        "low/d.py": "from low import c\nimport numpy\n",
        "high/__init__.py": "",
        "high/b.py": "from low.a import f\n",                          # down: fine
        "role1/x.py": "from role2.y import z\n",                       # joins two roles
        "role2/y.py": "from low import d\n",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    files, edges = import_edges(tmp_path, ("low", "high", "role1", "role2"))
    assert Edge("low.a", "high.b", 2, True) in edges
    assert not any(e.target == "numpy" for e in edges)
    found = violations(edges, (("low",), ("role1", "role2"), ("high",)), {"role1", "role2"})
    assert set(found) == {("low.a", "high.b"), ("low.c", "low.d"), ("low.d", "low.c"), ("role1.x", "role2.y")}
    assert "goes up from low to high" in found[("low.a", "high.b")][0]
    assert "closes a cycle among low.c, low.d" in found[("low.c", "low.d")][0]
