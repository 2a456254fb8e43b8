"""The client side of a CS system's front door (`cs_system serve`): csrun_wse and csctl.

    door = FrontDoor.open("127.0.0.1:9000", insecure=False, who="csctl")
    rows = door.request(Message(Msg.GET_JOBS)).meta["jobs"]

Finding the server's public key (the front door is a CURVE server): CS_SYSTEM_KEY
(the 40-character Z85 key, or the path of the server's `server.key`); without
it, the key of a CS system this user runs on this machine at that port (its
folder under the temporary directory). A wrong key fails the handshake.

Ownership: every user has an owner credential, 32 random bytes in
`~/.cs_emulator/owner.token` (CS_USER_DIR moves the folder; folder 0700,
file 0600), made on first use. A job remembers the SHA-256 of its
submitter's credential; cancelling or labelling a job sends the credential
(encrypted by CURVE) and the CS system compares. Whoever cannot read that
file cannot act on the user's jobs.
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import zmq
import zmq.auth

from cs_runtime.errors import CsError
from cs_runtime import env
from cs_runtime.wire import auth
from cs_runtime.process.directory_client import DIRECTORY_MAX_FRAME
from cs_runtime.launch.reachability import UnreachableError, check_reachable, check_tcp
from cs_runtime.wire.protocol import Message, Msg
from cs_runtime.wire.transport import Endpoint

USER_DIR_ENV = env.USER_DIR.name
SYSTEM_ENV = env.SYSTEM.name          # HOST:PORT of the CS system, for csctl
SYSTEM_KEY_ENV = env.SYSTEM_KEY.name
TOKEN_FILE = "owner.token"
REQUEST_TIMEOUT_S = 5.0


class FrontDoorError(CsError, RuntimeError):
    """The CS system cannot be reached, or refused the request (the message says which and why)."""


def split_address(text: str, what: str = "--cs_ip") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FrontDoorError(f"{what} {text!r} is not HOST:PORT")
    return host, int(port)


def user_dir() -> Path:
    return Path(env.USER_DIR.get() or Path.home() / ".cs_emulator")


def owner_token() -> str:
    """This user's owner credential (64 hex digits), made on first use."""
    folder = user_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if len(token) != 64 or any(c not in "0123456789abcdef" for c in token):
            raise FrontDoorError(f"{path} is not an owner credential (64 hex digits); delete it to make a new one")
        return token
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


CLIENT_KEY_FILE = "client.key_secret"


def client_key_pair() -> tuple[bytes, bytes]:
    """This user's CURVE key pair for front doors (public, secret), made on first use: a
    CS system run with --clients knows the user by this public key (`csctl key`)."""
    folder = user_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / CLIENT_KEY_FILE
    if not path.exists():
        public, secret = zmq.curve_keypair()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"# this user's key for CS systems' front doors\ncurve\n"
                    f"    public-key = \"{public.decode()}\"\n    secret-key = \"{secret.decode()}\"\n")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise FrontDoorError(f"{path} is not a CURVE key pair ({exc}); delete it to make a new one") from None
    if not secret:
        raise FrontDoorError(f"{path} has no secret key; delete it to make a new one")
    return public, secret


def user_name() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER", "unknown")


def system_public_key(host: str, port: int) -> bytes:
    given = env.SYSTEM_KEY.get()
    if given:
        if len(given) == 40 and not os.path.exists(given):
            return given.encode()
        try:
            return zmq.auth.load_certificate(given)[0]
        except (OSError, ValueError) as exc:
            raise FrontDoorError(f"{SYSTEM_KEY_ENV}={given}: not a Z85 key nor a readable server.key ({exc})") from None
    found = auth.find_system_key(port) if auth.is_loopback(host) else None
    if found is None:
        raise FrontDoorError(f"no public key for the CS system at {host}:{port}: set {SYSTEM_KEY_ENV} to the key "
                             "that `cs_system serve` printed (or to its server.key), or use --insecure if it runs so")
    return found


class FrontDoor:
    """One DEALER to the front door; requests are answered in order (matched by their number)."""

    def __init__(self, host: str, port: int, keys: auth.JobKeys | None):
        self.where = f"{host}:{port}"
        self.ctx = zmq.Context()
        self.endpoint = Endpoint(self.ctx, zmq.DEALER, "front door", "", max_frame_bytes=DIRECTORY_MAX_FRAME,
                                 keys=keys)
        self.endpoint.connect(f"tcp://{host}:{port}")
        self.sequence = 0

    @classmethod
    def open(cls, address: str, insecure: bool, what: str = "--cs_ip") -> "FrontDoor":
        """Check the CS system answers (TCP, then the CURVE handshake), then connect."""
        host, port = split_address(address, what)
        if insecure and not auth.is_loopback(host):
            raise FrontDoorError(f"--insecure is for loopback only, not {host}")
        try:
            check_tcp(host, port, what)
            keys = None if insecure else auth.JobKeys(Path(), system_public_key(host, port), b"",
                                                      *client_key_pair())
            check_reachable(host, port, what, keys=keys, insecure=insecure)
        except UnreachableError as exc:
            raise FrontDoorError(str(exc)) from None
        return cls(host, port, keys)

    def send(self, msg: Message) -> int:
        """Send a request without waiting; its number (answers carry it back as their step)."""
        self.sequence += 1
        msg.step = self.sequence
        self.endpoint.send(msg)
        return self.sequence

    def answer(self, number: int, timeout_s: float) -> Message | None:
        """The answer to request `number`, or None if none came within timeout_s (older answers are skipped)."""
        deadline = _now() + timeout_s
        while True:
            got = self.endpoint.recv(max(0, int((deadline - _now()) * 1000)))
            if got is None:
                return None
            if got[1].step == number:
                return got[1]

    def request(self, msg: Message, timeout_s: float = REQUEST_TIMEOUT_S) -> Message:
        """Send and wait for the answer; a refusal or no answer raises FrontDoorError. Asked to
        slow down (the server's rate limit), it waits as long as the refusal says and asks
        again, within timeout_s: a client paces itself instead of failing half way."""
        deadline = _now() + timeout_s
        while True:
            got = self.answer(self.send(msg), max(0.0, deadline - _now()))
            if got is None:
                raise FrontDoorError(f"cannot reach the CS system at {self.where} "
                                     f"(no answer within {timeout_s:.0f} s)")
            wait = got.meta.get("retry_after") if got.type == Msg.REFUSED else None
            if wait is None or _now() + wait >= deadline:
                break
            time.sleep(wait)   # pacing: the server said when it takes a request again
        if got.type == Msg.REFUSED:
            raise FrontDoorError(got.meta["reason"])
        return got

    def list_jobs(self) -> list[dict]:
        """Every job the CS system lists, page by page (each answer fits the header cap)."""
        rows, after = [], 0
        while True:
            page = self.request(Message(Msg.GET_JOBS, meta={"after": after})).meta
            rows += page["jobs"]
            if "next" not in page:
                return rows
            after = page["next"]

    def close(self) -> None:
        self.endpoint.close()
        self.ctx.destroy(linger=0)


def _now() -> float:
    return time.monotonic()


class SubmittedJob:
    """A job this process submitted: wait for its turn, keep it alive while it runs, report its end.

        job = SubmittedJob(door, num_csx=1, labels={}, keys=auth.job_keys())
        state = job.wait_turn()          # phase COMPILING: state["cs_ip"] is the job's directory
        ... run the chief and the input workers, calling job.check() often ...
        job.done("SUCCEEDED")
    """

    POLL_S = 0.5
    SILENCE_S = 10.0   # no answer this long: the CS system is gone

    def __init__(self, door: FrontDoor, num_csx: int, labels: dict[str, str], keys: auth.JobKeys | None):
        self.door, self.owner = door, owner_token()
        meta = {"user": user_name(), "num_csx": num_csx, "owner": self.owner, "labels": labels,
                "keys": auth.key_strings(keys) if keys else {}}
        self.state = door.request(Message(Msg.SUBMIT, meta=meta)).meta
        self.name = self.state["name"]
        self.unanswered: int | None = None
        self.last_sent = 0.0
        self.last_answer = _now()

    def wait_turn(self, on_queued=None) -> dict:
        """Poll until the job leaves the queue; the state then (COMPILING, or ended)."""
        position = None
        while self.state["phase"] == "QUEUED":
            if on_queued is not None and self.state["position"] != position:
                position = self.state["position"]
                on_queued(position)
            time.sleep(self.POLL_S)   # the poll interval, not synchronisation: the answer says what changed
            self.state = self.door.request(self.poll()).meta
        self.last_answer = _now()
        return self.state

    def poll(self) -> Message:
        return Message(Msg.JOB_POLL, meta={"name": self.name, "owner": self.owner})

    def check(self) -> dict:
        """Non-blocking: the latest state, sending a poll every POLL_S; raises FrontDoorError when silent."""
        if self.unanswered is not None:
            got = self.door.answer(self.unanswered, 0)
            if got is not None and "retry_after" in got.meta:
                self.unanswered = None   # slowed down (its host's clients share a budget): as unanswered
            elif got is not None:
                self.unanswered, self.last_answer = None, _now()
                if got.type == Msg.REFUSED:
                    raise FrontDoorError(got.meta["reason"])
                self.state = got.meta
        if self.unanswered is None and _now() - self.last_sent >= self.POLL_S:
            self.unanswered, self.last_sent = self.door.send(self.poll()), _now()
        if _now() - self.last_answer > self.SILENCE_S:
            raise FrontDoorError(f"the CS system at {self.door.where} stopped answering "
                                 f"(nothing for {self.SILENCE_S:.0f} s)")
        return self.state

    def done(self, phase: str, reason: str = "") -> None:
        """Tell the CS system how the job's tasks ended (best effort: it also notices silence)."""
        try:
            self.door.request(Message(Msg.JOB_DONE, meta={"name": self.name, "owner": self.owner,
                                                          "phase": phase, "reason": reason[:1000]}), timeout_s=2.0)
        except FrontDoorError:
            pass
