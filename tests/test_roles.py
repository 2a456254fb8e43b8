"""The role registry (cs_runtime/roles.py): the one place the roles are named."""
from __future__ import annotations

import ast
import importlib

from cs_runtime import roles
from tests.cluster_utils import REPO


def test_services_start_in_order_with_one_wse_per_system():
    assert roles.services_of_job(2) == [("memoryx", 0), ("swarmx", 0), ("wse", 0), ("wse", 1)]
    assert [roles.service_of_index(i) for i in range(4)] == roles.services_of_job(2)
    assert roles.service_counts(3) == {"memoryx": 1, "swarmx": 1, "wse": 3}


def test_every_role_has_a_module_or_an_entry_point_that_exists():
    for role in roles.ROLES.values():
        if role.is_service:
            assert importlib.util.find_spec(role.module) is not None, role
        else:
            module, function = role.entry
            assert callable(getattr(importlib.import_module(module), function)), role
    assert roles.entry_point("chief") == roles.ROLES["chief"].entry
    assert roles.entry_point("") == roles.entry_point("no-such-role") == ("chief.trainer", "run_on_cpu")


def test_only_the_wse_shares_the_cores():
    assert roles.ROLES["wse"].threads(2, cores=16) == 8
    assert roles.ROLES["wse"].threads(32, cores=16) == 1
    assert {roles.ROLES[name].threads(2, cores=16) for name in ("memoryx", "swarmx", "chief", "worker")} == {1}


def test_no_other_module_spells_a_service_module():
    """`python -m <service>` is written in the registry only: a string literal naming a service's
    module anywhere else in the product code is a second spelling."""
    # The dotted ones: the WSE's module is also its role's name, which every role may say.
    modules = {role.module for role in roles.ROLES.values() if role.is_service and "." in role.module}
    assert modules
    offenders = []
    for package in ("cs_runtime", "chief", "worker", "wse", "cs_torch"):
        for path in (REPO / package).rglob("*.py"):
            if path == REPO / "cs_runtime" / "roles.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in modules:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders
