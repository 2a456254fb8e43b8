"""csctl's job listing against a stand-in CS system (no process): `get jobs`, `get job NAME`.

The whole path, with a real `cs_system serve`: tests/test_appliance.py.
"""
from __future__ import annotations

import json

import pytest

from cs_runtime.cli import csctl

JOBS = [{"name": "wsjob-7", "age_s": 65.0, "duration_s": 3.0, "phase": "FAILED", "systems": [], "user": "ann",
         "labels": {"case": "bad"}, "reason": "params: optimizer.learning_rat: unknown key"},
        {"name": "wsjob-8", "age_s": 5.0, "duration_s": None, "phase": "RUNNING", "systems": ["cs0"],
         "user": "bob", "labels": {}, "reason": ""}]


class FakeDoor:
    def list_jobs(self):
        return [dict(j) for j in JOBS]

    def close(self):
        pass


@pytest.fixture
def door(monkeypatch):
    monkeypatch.setattr(csctl.FrontDoor, "open", classmethod(lambda cls, *a, **k: FakeDoor()))


def run(argv, capsys):
    csctl.main(["--cs_ip", "127.0.0.1:1", *argv])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["7", "wsjob-7"])
def test_get_job_by_name_shows_that_job_and_why_it_failed(door, capsys, name):
    out = run(["get", "job", name], capsys).splitlines()
    assert out[0].split()[:4] == ["NAME", "AGE", "DURATION", "PHASE"]
    assert out[1].split()[:4] == ["wsjob-7", "1m5s", "3s", "FAILED"] and len(out) == 3
    assert out[2] == "REASON: params: optimizer.learning_rat: unknown key"


def test_get_job_json_is_the_one_row(door, capsys):
    assert json.loads(run(["get", "job", "8", "-o", "json"], capsys))["name"] == "wsjob-8"
    listed = json.loads(run(["get", "jobs", "-o", "json"], capsys))["jobs"]
    assert [j["name"] for j in listed] == ["wsjob-7", "wsjob-8"]
    running = run(["get", "job", "wsjob-8"], capsys).splitlines()
    assert len(running) == 2 and running[1].split()[3] == "RUNNING"   # no reason: no REASON line


@pytest.mark.parametrize("name,says", [("9", "no job wsjob-9 on 127.0.0.1:1"), ("x y", "is not a job id")])
def test_get_job_unknown_or_malformed_is_one_line(door, capsys, name, says):
    with pytest.raises(SystemExit) as err:
        run(["get", "job", name], capsys)
    assert says in str(err.value) and str(err.value).startswith("csctl: ") and "\n" not in str(err.value)
