"""A small LAN of network namespaces for multi-host fleet tests (root and iproute2 needed).

One "lan" namespace holds a bridge; every host (the head and the workers) is its own namespace
joined to the bridge by a veth pair, with one address from 198.51.100.0/24 (TEST-NET-2, routed
nowhere) and its loopback up. Nothing is configured outside these namespaces; the only thing in
the root namespace is the namespace names. Every process a host runs is found again through
``ip netns pids`` and killed by id on teardown, which then deletes the namespaces (and with the
lan namespace the bridge and every veth).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.51.100"
HEAD_ADDR = f"{SUBNET}.1"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_available() -> str | None:
    """Why namespaced tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("ss"):
        return "needs iproute2 (ip, ss)"
    probe = f"ftprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"cannot create a network namespace: {made.stderr.strip()}"


@dataclass
class Host:
    """One machine of the test LAN: a namespace, its address, its own home and Ray temp dir."""

    name: str
    netns: str
    addr: str
    lan_dev: str  # the bridge-side end of its veth pair, inside the lan namespace
    root: Path
    lan: Lan = field(repr=False)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def ray_tmp(self) -> Path:
        return self.root / "ray"

    def env(self, **extra: str) -> dict:
        """The environment of a fleettune command on this host: its own data dir and Ray temp dir,
        no token or Ray setting inherited from the test process."""
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("RAY_", "FLEETTUNE_")) and k not in ("HOME",)}
        return {**base, "HOME": str(self.home), "FLEETTUNE_HOME": str(self.home / "fleettune"),
                "RAY_TMPDIR": str(self.ray_tmp), **extra}

    def argv(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, *args: str, env: dict | None = None, timeout: float = 180,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run a command on this host and wait for it (bounded by ``timeout``)."""
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                              env=env if env is not None else self.env(), input=input, check=False)

    def spawn(self, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """Start a command on this host in the background (killed on teardown)."""
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
        try:
            return subprocess.Popen(self.argv(*args), stdout=out, stderr=subprocess.STDOUT,
                                    env=env if env is not None else self.env(), start_new_session=True)
        finally:
            if log:
                out.close()

    def pids(self) -> list[int]:
        done = ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split()]

    def listeners(self) -> list[tuple[str, int, str]]:
        """Every listening TCP socket of this host: (address, port, process names), from ``ss``."""
        done = self.run("ss", "-Hltnp", env=os.environ.copy(), timeout=30)
        out = []
        for line in done.stdout.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            local = cols[3]
            addr, _, port = local.rpartition(":")
            procs = cols[5] if len(cols) > 5 else ""
            out.append((addr.strip("[]"), int(port), procs))
        return out

    def link(self, up: bool) -> None:
        """Plug or unplug this host's cable (its port on the bridge). Plugged back: the port is
        up, and every host forgets the neighbours it failed to reach meanwhile (a FAILED entry
        answers "No route to host" at once instead of asking again), as a real host does after a
        moment; a service restarted right away then reaches the head."""
        ip("-n", self.lan.netns, "link", "set", self.lan_dev, "up" if up else "down")
        if up:
            wait_for(lambda: "state UP" in ip("-n", self.lan.netns, "link", "show", self.lan_dev).stdout,
                     30, f"{self.name}'s bridge port up")
            for host in self.lan.hosts.values():
                ip("-n", host.netns, "neigh", "flush", "all", check=False)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


class Lan:
    """The bridge namespace plus one namespace per host; ``close`` undoes all of it."""

    made = 0  # LANs made by this process, to keep their namespace names apart

    def __init__(self, root: Path, workers: int = 3, extra: dict[str, int] | None = None) -> None:
        Lan.made += 1
        self.tag = f"ft{os.getpid() % 100000}x{Lan.made}"
        self.netns = f"{self.tag}-lan"
        self.root = root
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            self._add_ns(self.netns)
            ip("-n", self.netns, "link", "set", "lo", "up")
            ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
            ip("-n", self.netns, "link", "set", "br0", "up")
            self._add_host("head", HEAD_ADDR)
            for i in range(1, workers + 1):
                self._add_host(f"w{i}", f"{SUBNET}.{10 + i}")
            for name, last in (extra or {}).items():  # hosts that are not fleet workers
                self._add_host(name, f"{SUBNET}.{last}")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        ip("netns", "del", name, check=False)  # a leftover of a killed earlier run with this pid
        ip("netns", "add", name)
        self._made.append(name)

    def _add_host(self, name: str, addr: str) -> None:
        netns = f"{self.tag}-{name}"
        self._add_ns(netns)
        lan_dev = f"p-{name}"
        ip("-n", self.netns, "link", "add", lan_dev, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("-n", self.netns, "link", "set", lan_dev, "master", "br0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        host = Host(name, netns, addr, lan_dev, self.root / name, self)
        for d in (host.home, host.ray_tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.hosts[name] = host

    @property
    def head(self) -> Host:
        return self.hosts["head"]

    @property
    def workers(self) -> list[Host]:
        return [h for n, h in self.hosts.items() if n.startswith("w")]

    def close(self) -> None:
        """Kill every process left in the hosts' namespaces (by id), then delete the namespaces."""
        for name in self._made:
            host = next((h for h in self.hosts.values() if h.netns == name), None)
            if host is None:
                continue
            for _ in range(50):  # bounded: Ray's daemons may fork while we kill them
                if not host.pids():
                    break
                host.kill_all()
                time.sleep(0.1)  # let the kernel reap them before looking again
        for name in reversed(self._made):
            ip("netns", "del", name, check=False)
        self._made.clear()


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Poll ``condition`` until truthy (returned), or raise naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)  # polling a condition, not a guess at how long something takes
    raise TimeoutError(f"{what}: not within {timeout:g}s")
