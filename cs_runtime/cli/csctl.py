"""csctl: look at and steer the jobs of a CS system (`cs_system serve`).

    csctl [--cs_ip HOST:PORT] get jobs [-o table|json]
    csctl [--cs_ip HOST:PORT] get job ID [-o table|json]   # one job; the table adds why it failed
    csctl [--cs_ip HOST:PORT] cancel job ID          # ID: 7 or wsjob-7; its owner only
    csctl [--cs_ip HOST:PORT] label job ID KEY=VALUE [KEY=VALUE ...]
    csctl key        # this user's line for a CS system's `cs_system serve --clients FILE`

The CS system is --cs_ip, else $CS_SYSTEM. Cancelling or labelling a job
needs the owner credential of the user who submitted it (~/.cs_emulator/
owner.token, see cs_runtime/launch/front_door.py). With neither, csctl
looks at the jobs this user runs on this machine with a CS system of their
own (csrun_wse, run.py CSX or a cstorch CSX backend without --cs_ip /
--mgmt_address; cs_runtime/launch/local_jobs.py): cancelling one stops it
as Ctrl-C in its own shell would. Errors are one line, exit code 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from cs_runtime import env
from cs_runtime.flags import add_flag
from cs_runtime.launch import local_jobs
from cs_runtime.launch.front_door import (SYSTEM_ENV, FrontDoor, FrontDoorError, client_key_pair, owner_token,
                                         user_name)
from cs_runtime.wire.protocol import JOB_NAME, Message, Msg, check_labels, printable
from cs_runtime.version import version_line

COLUMNS = ("NAME", "AGE", "DURATION", "PHASE", "SYSTEMS", "USER", "LABELS")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csctl", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("csctl"))
    add_flag(parser, "cs_ip", default=env.SYSTEM.get(),
             help=f"HOST:PORT of the CS system (default ${SYSTEM_ENV}; without either: this user's jobs here)")
    parser.add_argument("--insecure", action="store_true", help="the CS system runs without CURVE (loopback)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("get", help="list jobs")
    get.add_argument("kind", choices=("jobs", "job"))
    get.add_argument("job", nargs="?", help="one job: 7 or wsjob-7 (default: all)")
    get.add_argument("-o", "--output", choices=("table", "json"), default="table")
    cancel = verbs.add_parser("cancel", help="stop a job and free its systems")
    cancel.add_argument("kind", choices=("job",))
    cancel.add_argument("job")
    label = verbs.add_parser("label", help="set labels on a job")
    label.add_argument("kind", choices=("job",))
    label.add_argument("job")
    label.add_argument("labels", nargs="+", metavar="KEY=VALUE")
    verbs.add_parser("key", help="print `USER PUBLIC_KEY`: this user's line for a CS system's --clients file")
    return parser.parse_args(argv)


def job_name(text: str) -> str:
    name = text if text.startswith("wsjob-") else f"wsjob-{text}"
    if not JOB_NAME.match(name):
        raise FrontDoorError(f"{text!r} is not a job id (7 or wsjob-7)")
    return name


def parse_labels(pairs: list[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise FrontDoorError(f"label {pair!r} is not KEY=VALUE")
        labels[key] = value
    check_labels(labels, FrontDoorError)
    return labels


def age(seconds: float | None) -> str:
    """kubectl's style: 42s, 3m5s, 2h4m, 3d."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d"


def table(jobs: list[dict]) -> str:
    rows = [COLUMNS] + [(j["name"], age(j["age_s"]), age(j["duration_s"]), j["phase"],
                         ",".join(j["systems"]) or "-", j["user"],
                         ",".join(f"{k}={v}" for k, v in sorted(j["labels"].items())) or "-") for j in jobs]
    rows = [tuple(printable(str(cell), 10_000) for cell in row) for row in rows]   # whatever the server sent
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def get(jobs: list[dict], wanted: str | None, output: str, where: str) -> str:
    """Every job, or the one named (an error when the CS system has no such job)."""
    if wanted is None:
        return json.dumps({"jobs": jobs}, indent=2) if output == "json" else table(jobs)
    name = job_name(wanted)
    found = [j for j in jobs if j["name"] == name]
    if not found:
        raise FrontDoorError(f"no job {name} on {where} ({len(jobs)} job(s) there: csctl get jobs)")
    job = found[0]
    if output == "json":
        return json.dumps(job, indent=2)
    return table([job]) + (f"\nREASON: {printable(job['reason'])}" if job.get("reason") else "")


def run_local(ns: argparse.Namespace) -> str:
    """The verbs on this user's jobs that run here with a CS system of their own."""
    if ns.verb == "get":
        now = time.time()
        return get([job.row(now) for job in local_jobs.jobs()], ns.job, ns.output, "this machine")
    name = job_name(ns.job)
    if ns.verb == "cancel":
        local_jobs.cancel(name)
        return f"{name} cancelled"
    local_jobs.label(name, parse_labels(ns.labels))
    return f"{name} labelled"


def run(ns: argparse.Namespace) -> str:
    if ns.verb == "key":
        return f"{user_name()} {client_key_pair()[0].decode()}"
    if not ns.cs_ip:
        return run_local(ns)
    door = FrontDoor.open(ns.cs_ip, ns.insecure, what="the CS system at")
    try:
        if ns.verb == "get":
            return get(door.list_jobs(), ns.job, ns.output, ns.cs_ip)
        name = job_name(ns.job)
        if ns.verb == "cancel":
            door.request(Message(Msg.CANCEL, meta={"name": name, "owner": owner_token()}))
            return f"{name} cancelled"
        door.request(Message(Msg.LABEL, meta={"name": name, "owner": owner_token(),
                                               "labels": parse_labels(ns.labels)}))
        return f"{name} labelled"
    finally:
        door.close()


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(run(ns), flush=True)
    except (FrontDoorError, local_jobs.LocalJobError) as exc:
        raise SystemExit(f"csctl: {exc}") from None


if __name__ == "__main__":
    main()
