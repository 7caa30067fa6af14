"""A head started with `--host 127.0.0.1` on a machine that has a network interface listens on
loopback only: every Ray server of it (GCS, raylet, object manager, agents, Ray client), checked
with `ss` (issue 24, case 10). Ray replaces a loopback node address with the machine's own unless
told clusters are off, and then binds every interface.

The head runs with its own data dir and Ray temp dir; its processes are found by a marker in
their environment and stopped by their ids (never `ray stop`, which would stop every Ray
process of this user on a shared machine)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.conftest import wait_until

MARKER = "FLEETTUNE_TEST_MARKER"
FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(shutil.which("ss") is None or not Path("/proc/self/environ").exists(),
                                 reason="needs ss and /proc")]


def _outside_addresses() -> list[str]:
    """This machine's IPv4 addresses off loopback (from `ip -4 -o addr`)."""
    done = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False)
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", done.stdout)
    return [a for a in found if not ipaddress.ip_address(a).is_loopback]


def _marked(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARKER}={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(address, process) of every listening TCP socket the processes ``pids`` hold."""
    done = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30, check=False)
    out = []
    for line in done.stdout.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        owners = {int(p) for p in re.findall(r"pid=(\d+)", cols[5])}
        if owners & pids:
            out.append((cols[3].rpartition(":")[0].strip("[]"), cols[5]))
    return out


def _is_loopback(addr: str) -> bool:
    """An address `ss` prints (``*``, ``0.0.0.0``, ``::ffff:127.0.0.1``, ``fe80::1%eth0``) is loopback."""
    if addr == "*":
        return False
    ip = ipaddress.ip_address(addr.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_loopback_head_binds_every_ray_server_to_loopback(tmp_path):
    if not _outside_addresses():
        pytest.skip("this machine has no address off loopback: nothing to show")
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "FLEETTUNE_"))}
    ray_tmp = tempfile.mkdtemp(prefix="ftlb-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    env.update({MARKER: marker, "HOME": str(tmp_path), "FLEETTUNE_HOME": str(tmp_path / "ft"), "RAY_TMPDIR": ray_tmp,
                # a loaded machine (the whole suite on 2 cores) can take Ray's agents past its 30 s
                "RAY_agent_register_timeout_ms": "180000"})
    try:
        done = subprocess.run([FLEETTUNE, "head", "start", "--host", "127.0.0.1", "--port", str(_free_port())],
                              capture_output=True, text=True, env=env, timeout=240, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        pids = set(wait_until(lambda: _marked(marker), timeout=60))
        names = {"gcs_server", "raylet"}
        listening = wait_until(lambda: (found := _listeners(set(_marked(marker)))) and
                               names <= {n for _, p in found for n in re.findall(r'"([^"]+)"', p)} and found,
                               timeout=120)
        wide = [(addr, procs) for addr, procs in listening if not _is_loopback(addr)]
        assert not wide, wide
        assert pids
    finally:
        for pid in _marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not [p for p in _marked(marker) if _alive(p)], timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
