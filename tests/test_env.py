"""cs_runtime/env.py: the one table of CS_* environment variables, and that nothing reads another."""
from __future__ import annotations

import re

import pytest

from cs_runtime import env
from tests.cluster_utils import REPO

PRODUCT = ("cs_runtime", "chief", "worker", "wse", "cs_torch", "scripts")


def test_every_variable_is_named_once_with_a_meaning():
    names = [v.name for v in env.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("CS_") for n in names)
    assert all(v.meaning and v.scope in ("job", "process", "user", "internal") for v in env.ALL)


def test_no_cs_variable_outside_the_table():
    """A CS_* name in the product code is one of env.py's (so its default and parser are there)."""
    known = {v.name for v in env.ALL}
    found = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for name in re.findall(r"\bCS_[A-Z][A-Z0-9_]*\b", path.read_text()):
                found.setdefault(name, str(path.relative_to(REPO)))
    assert {n: p for n, p in found.items() if n not in known} == {}


def test_unset_or_empty_reads_as_the_default_and_values_parse():
    assert env.RANK.get({}) == 0 and env.RANK.get({"CS_RANK": ""}) == 0 and env.RANK.get({"CS_RANK": "3"}) == 3
    assert env.TRACE.get({"CS_TRACE": "0"}) is False and env.TRACE.get({"CS_TRACE": "1"}) is True
    assert env.LOG_LEVEL.get({"CS_LOG_LEVEL": "debug"}) == "DEBUG"
    assert env.BIND_HOST.get({}) == "127.0.0.1"


@pytest.mark.parametrize("var,raw", [(env.RANK, "-1"), (env.NUM_CSX, "0"), (env.TARGET, "gpu"),
                                     (env.PROBE_SECONDS, "soon")])
def test_a_bad_value_names_the_variable(var, raw):
    with pytest.raises(env.EnvError, match=rf"^{var.name}='{raw}': expected"):
        var.get({var.name: raw})


def test_the_per_job_lists_are_views_of_the_table():
    assert set(env.PROCESS_VARS) == {"CS_ROLE", "CS_RANK", "CS_HOST_NAME", "CS_BIND_HOST"}
    assert set(env.PROCESS_VARS) < set(env.JOB_VARS)
    assert {"CS_JOB_ID", "CS_KEYS_DIR", "CS_RESTART", "CS_TRACE"} < set(env.JOB_VARS)
    assert "CS_LOG_LEVEL" not in env.JOB_VARS   # the user's, passed on to every process
    assert set(env.SERVICE_VARS) == {"CS_JOB_ID", "CS_IP", "CS_ROLE", "CS_RANK", "CS_NUM_CSX", "CS_KEYS_DIR",
                                     "CS_SHM_DIR", "CS_BIND_HOST"}


def test_the_table_lists_every_variable():
    table = env.table()
    assert all(f"`{v.name}`" in table for v in env.ALL)


def test_the_docs_table_lists_every_variable():
    page = (REPO / "docs" / "environment.md").read_text()
    assert [v.name for v in env.ALL if f"`{v.name}`" not in page] == []
