"""Several hosts on this machine: network namespaces, each running Debian's sshd.

    hosts = NetnsHosts.start(tmp_path, count=2)   # needs root, ip, sshd, ssh, ssh-keygen
    ... csrun_wse --ssh_options "{hosts.ssh_options}" -H {hosts.addresses[0]},{hosts.addresses[1]} ...
    hosts.stop()

Layout: a bridge in the root namespace holding 10.213.N.1/24, and per host a
namespace with a veth into the bridge holding 10.213.N.(i+2). The hosts reach
the launcher and each other over the bridge (no IP forwarding needed). N and
every interface and namespace name derive from this process's pid, so
parallel runs do not collide. sshd runs from a config file in tmp (its own
host key, an authorized_keys file with a key made for this run): nothing in
/etc or ~/.ssh is touched. `stop` undoes everything, also after a failed
start: it kills every process left in the namespaces, deletes them and the
bridge.

`private_tmp=(i, ...)`: those hosts get a /tmp of their own (sshd starts in a
mount namespace with a fresh tmpfs there) in which only `keep` (the tests'
folders) is seen: like a cluster node whose /tmp is not the launcher's.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NEEDED = ("ip", "ssh", "ssh-keygen")
SSHD = "/usr/sbin/sshd"
SUBNET_PREFIX = "10.213"
READY_TIMEOUT_S = 20.0


def missing_requirement() -> str | None:
    """Why these hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    missing = [b for b in NEEDED if shutil.which(b) is None] + ([SSHD] if not os.access(SSHD, os.X_OK) else [])
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y openssh-server openssh-client iproute2)"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result


def free_subnet(pid: int) -> str:
    """10.213.N: the first N from pid % 250 on that no route on this machine uses."""
    routes = sh("ip", "-4", "route", "show").stdout
    for k in range(250):
        n = 1 + (pid + k) % 250
        if f"{SUBNET_PREFIX}.{n}." not in routes:
            return f"{SUBNET_PREFIX}.{n}"
    raise RuntimeError(f"no free /24 in {SUBNET_PREFIX}.0.0/16")


@dataclass
class NetnsHosts:
    tmp: Path
    tag: str
    subnet: str = ""
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    bridge: str = ""
    sshd_pidfiles: list[Path] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @property
    def ssh_options(self) -> str:
        return (f"-F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                f"-o LogLevel=ERROR -o ConnectTimeout=5 -i {self.tmp / 'id_ed25519'}")

    @classmethod
    def start(cls, tmp: Path, count: int = 2, private_tmp: tuple[int, ...] = (), keep: Path | None = None,
              tag: str = "") -> "NetnsHosts":
        pid = os.getpid()
        hosts = cls(tmp, f"cs{pid}{tag}")
        try:
            hosts.make_network(count)
            hosts.make_keys()
            for index in range(count):
                hosts.start_sshd(index, keep or tmp if index in private_tmp else None)
            for address in hosts.addresses:
                wait_for_port(address, 22)
        except BaseException:
            hosts.stop()
            raise
        return hosts

    def make_network(self, count: int) -> None:
        self.subnet = free_subnet(os.getpid())
        self.bridge = f"{self.tag}br"
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for index in range(count):
            ns, outer, inner = f"{self.tag}h{index}", f"{self.tag}v{index}", f"{self.tag}p{index}"
            address = f"{self.subnet}.{index + 2}"
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", outer, "master", self.bridge)
            sh("ip", "link", "set", outer, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            self.addresses.append(address)

    def make_keys(self) -> None:
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / "host_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / "id_ed25519"))
        shutil.copy(self.tmp / "id_ed25519.pub", self.tmp / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    def start_sshd(self, index: int, private_tmp_keeping: Path | None = None) -> None:
        pidfile = self.tmp / f"sshd{index}.pid"
        config = self.tmp / f"sshd{index}.conf"
        config.write_text("\n".join([
            f"ListenAddress {self.addresses[index]}", f"HostKey {self.tmp / 'host_key'}",
            f"PidFile {pidfile}", f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "StrictModes no", "UsePAM no", "PrintMotd no", ""]))
        self.sshd_pidfiles.append(pidfile)
        sshd = [SSHD, "-f", str(config), "-E", str(self.tmp / f"sshd{index}.log")]
        if private_tmp_keeping is None:
            sh("ip", "netns", "exec", self.namespaces[index], *sshd)
            return
        # A fresh tmpfs on /tmp, then `keep` bound back in through a descriptor opened before
        # (--no-canonicalize: the path would name the new, empty folder).
        keep = shlex.quote(str(private_tmp_keeping))
        script = (f"exec 3<{keep} && mount -t tmpfs cs-private-tmp /tmp && mkdir -p {keep} && "
                  f"mount --no-canonicalize --bind /proc/$$/fd/3 {keep} && exec 3<&- && "
                  f"exec {' '.join(shlex.quote(a) for a in sshd)}")
        sh("ip", "netns", "exec", self.namespaces[index], "unshare", "--mount", "--propagation", "private",
           "sh", "-c", script)

    def pids(self, namespace: str) -> list[int]:
        out = sh("ip", "netns", "pids", namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def job_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process in the namespaces other than the sshd listeners."""
        listeners = {_read_pid(p) for p in self.sshd_pidfiles}
        found = []
        for ns in self.namespaces:
            for pid in self.pids(ns):
                if pid not in listeners:
                    found.append((pid, _cmdline(pid)))
        return [(pid, cmd) for pid, cmd in found if cmd]

    def stop(self) -> None:
        for pidfile in self.sshd_pidfiles:
            _kill(_read_pid(pidfile), signal.SIGTERM)
        for ns in self.namespaces:
            for pid in self.pids(ns):
                _kill(pid, signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
        if self.bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        self.namespaces, self.bridge = [], ""


def wait_for_port(address: str, port: int, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address} did not start listening within {timeout:.0f} s")
            time.sleep(0.1)  # polling a port for readiness; there is nothing to wait on


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _kill(pid: int | None, sig: int) -> None:
    if pid:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
