"""Per-job CURVE keys: every socket of a job is authenticated and encrypted.

The launcher makes a private job folder (mode 0700) and in it two CURVE key
pairs with zmq.auth (`server.key[_secret]`, `client.key[_secret]`, every
file 0600). Its processes learn the folder from the environment
(CS_KEYS_DIR), never from a command line. Every socket that binds is a CURVE
server with the server secret and a ZAP handler (zmq.auth's
ThreadAuthenticator) that admits only the job's public keys; every socket
that connects is a CURVE client that knows the server's public key. A peer
without the job's keys cannot finish the handshake, so not a byte it sends
reaches the protocol layer.

Without CS_KEYS_DIR (csrun_wse --insecure, or a test that builds sockets
itself) sockets are plain TCP, and binding anything but loopback is refused.

    keys_dir = create_job_dir()          # launcher: per job, removed at the end
    env["CS_KEYS_DIR"] = str(keys_dir)   # handed to the job's processes only
"""
from __future__ import annotations

import functools
import ipaddress
import logging
import os
import shutil
import socket as pysocket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cs_runtime.errors import CsError
from cs_runtime import env

log = logging.getLogger(__name__)

KEYS_ENV = env.KEYS_DIR.name
# The job's keys as text (key_strings' JSON), for a task on a host without the launcher's
# file system: srun's environment carries it to the task wrapper, which writes them there.
KEYS_TEXT_ENV = env.JOB_KEYS.name
JOB_DIR_PREFIX = "csjob-"
SYSTEM_DIR_PREFIX = "cssys-"  # a CS system's front-door keys (cs_system serve)
PORT_FILE = "port"             # in a CS system's folder: the port of its front door
OWNER_FILE = "launcher.pid"   # the pid of the launcher that made the folder


class AuthError(CsError, RuntimeError):
    pass


@dataclass(frozen=True)
class JobKeys:
    folder: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def create_job_dir() -> Path:
    """A private folder (0700) holding fresh key pairs for one job (files 0600)."""
    remove_stale_job_dirs()
    folder = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX))  # mkdtemp makes it 0700
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(folder, name)
        # zmq.auth writes with the umask; nobody but the owner may read a key.
        for path in (public, secret):
            os.chmod(path, 0o600)
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    os.chmod(folder / OWNER_FILE, 0o600)
    return folder


def write_job_dir(keys: dict[str, str]) -> Path:
    """A private folder (0700) with the job keys a submitter sent (key_strings' form), files 0600.

    The CS system's services serve a job submitted from elsewhere with that job's own keys.
    """
    remove_stale_job_dirs()
    folder = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX))
    for name in ("server", "client"):
        public, secret = keys[f"{name}_public"], keys[f"{name}_secret"]
        # zmq.auth's own writer, so that zmq.auth.load_certificate reads the files back.
        zmq.auth.certs._write_key_file(folder / f"{name}.key", _BANNER, public)
        zmq.auth.certs._write_key_file(folder / f"{name}.key_secret", _BANNER, public, secret)
        for suffix in (".key", ".key_secret"):
            os.chmod(folder / f"{name}{suffix}", 0o600)
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    return folder


_BANNER = "#   ZeroMQ CURVE certificate of one cs-emulator job, written {}\n"


def keys_from_text(keys: object) -> dict[str, str]:
    """key_strings' form, checked (it arrives from a launcher over ssh or srun)."""
    names = ("server_public", "server_secret", "client_public", "client_secret")
    if not isinstance(keys, dict) or set(keys) != set(names) \
            or not all(isinstance(keys[n], str) and len(keys[n]) == 40 for n in names):
        raise AuthError(f"the job's keys must be {', '.join(names)}: 40 characters of Z85 each")
    return {n: keys[n] for n in names}


def key_strings(keys: JobKeys) -> dict[str, str]:
    """The job's four keys as Z85 text (what SUBMIT carries to a CS system)."""
    return {"server_public": keys.server_public.decode(), "server_secret": keys.server_secret.decode(),
            "client_public": keys.client_public.decode(), "client_secret": keys.client_secret.decode()}


def create_system_dir() -> tuple[Path, JobKeys]:
    """A CS system's front-door key pair in a private folder (0700; the secret 0600)."""
    remove_stale_job_dirs(SYSTEM_DIR_PREFIX)
    folder = Path(tempfile.mkdtemp(prefix=SYSTEM_DIR_PREFIX))
    public_file, secret_file = zmq.auth.create_certificates(folder, "server")
    for path in (public_file, secret_file):
        os.chmod(path, 0o600)
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    public, secret = zmq.auth.load_certificate(secret_file)
    return folder, JobKeys(folder, public, secret, b"", b"")


def write_system_port(folder: Path, port: int) -> None:
    """Record the front door's port, so that this user's clients on this machine find the key."""
    (folder / PORT_FILE).write_text(str(port))


def find_system_key(port: int) -> bytes | None:
    """The front-door public key of a live CS system of this user on this machine at `port`."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SYSTEM_DIR_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid() or int((folder / PORT_FILE).read_text()) != port \
                    or not pid_alive(int((folder / OWNER_FILE).read_text())):
                continue
            return zmq.auth.load_certificate(folder / "server.key")[0]
        except (OSError, ValueError):
            continue
    return None


def remove_stale_job_dirs(prefix: str = JOB_DIR_PREFIX) -> None:
    """Folders left by a launcher that was killed with SIGKILL (its cleanup never ran)."""
    for folder in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being made right now
        if not pid_alive(owner):
            remove_job_dir(folder)


def remove_dead_owners_folders() -> None:
    """Every job and CS system key folder of this user whose maker is gone."""
    remove_stale_job_dirs(JOB_DIR_PREFIX)
    remove_stale_job_dirs(SYSTEM_DIR_PREFIX)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_job_dir(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


# The watcher: waits for EOF on a pipe whose only writer is the process that made the folder
# (the write end is not inherited by its children), then removes the folder if it is still
# there. Plain `python -S`, nothing imported but os and shutil: it starts in some 20 ms.
_WATCHER = """
import os, shutil, sys
fd, folder = int(sys.argv[1]), sys.argv[2]
try:
    while os.read(fd, 64):
        pass
except OSError:
    pass
shutil.rmtree(folder, ignore_errors=True)
"""


class FolderWatch:
    """A small process that removes `folder` as soon as this process is gone, however it ends
    (kill -9 included): the key folder of a launcher killed before its services started, or
    between a restart's attempts, when no service is there to remove it. `close()` (at the
    job's end, after removing the folder) stops it."""

    def __init__(self, folder: Path):
        import subprocess
        import sys
        read_end, self._write_end = os.pipe()   # both not inheritable (PEP 446): passed explicitly
        try:
            # Its own session: a signal to the launcher's terminal group must not take it first.
            self.proc = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(read_end), str(folder)],
                                         pass_fds=(read_end,), start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            os.close(read_end)

    def close(self) -> None:
        """The owner removed the folder: the watcher has nothing left to do, and is stopped rather than
        waited for, since a child forked from this process (a torch DataLoader's worker) holds the
        pipe's write end too, and the watcher would see its EOF only once that child is gone."""
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
            self.proc.kill()
            self.proc.wait()


@functools.lru_cache(maxsize=8)
def load_keys(folder: str) -> JobKeys:
    path = Path(folder)
    try:
        server_public, server_secret = zmq.auth.load_certificate(path / "server.key_secret")
        client_public, client_secret = zmq.auth.load_certificate(path / "client.key_secret")
    except (OSError, ValueError) as exc:
        raise AuthError(f"cannot read the job's CURVE keys in {folder}: {exc}") from None
    if not (server_secret and client_secret):
        raise AuthError(f"CURVE key files in {folder} have no secret key")
    return JobKeys(path, server_public, server_secret, client_public, client_secret)


def job_keys() -> JobKeys | None:
    """This process's job keys, or None when the job runs without CURVE."""
    folder = env.KEYS_DIR.get()
    return load_keys(folder) if folder else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(pysocket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------ sockets
_authenticators: dict[int, ThreadAuthenticator] = {}
_auth_lock = threading.Lock()


def secure_server(ctx: zmq.Context, sock: zmq.Socket, host: str, keys: JobKeys | None = None,
                  any_client: bool | frozenset = False) -> None:
    """Make `sock` (about to bind on `host`) a CURVE server admitting only the job's keys.

    any_client: True admits every client key (a CS system's front door, where who may do
    what is decided per request); a set of Z85 public keys admits those only (the front
    door's allow-list, `cs_system serve --clients`). The traffic is encrypted and the
    server authenticated either way.
    """
    keys = keys or job_keys()
    if keys is None:
        if not is_loopback(host):
            raise AuthError(f"refusing to bind {host} without CURVE keys ({KEYS_ENV} not set): "
                            "only loopback may run insecure")
        return
    _start_authenticator(ctx, keys, any_client)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: JobKeys | None = None) -> None:
    """Make `sock` (about to connect) a CURVE client of the job's servers."""
    keys = keys or job_keys()
    if keys is None:
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def _start_authenticator(ctx: zmq.Context, keys: JobKeys, any_client: bool = False) -> None:
    # One ZAP handler per context: it answers for every CURVE server socket in it.
    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("cs_runtime.wire.auth.zap"))
        auth.start()
        # Every *.key in the job folder: the job's client and server public keys.
        if isinstance(any_client, frozenset):
            auth.configure_curve_callback(domain="*", credentials_provider=AllowList(any_client))
        else:
            auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY if any_client else str(keys.folder))
        _authenticators[id(ctx)] = auth


class AllowList:
    """A ZAP credentials provider: admits the listed client public keys (Z85) only."""

    def __init__(self, keys: frozenset):
        self.keys = frozenset(k.encode() if isinstance(k, str) else k for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the ZAP thread of `ctx`; call before ctx.destroy()."""
    with _auth_lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
