"""The lease's zombie check asks the platform (POSIX ps), so it answers on macOS as on Linux."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from orchestrator import lease
from tests.conftest import wait_until


def owner_of(pid: int) -> str:
    return f"{socket.gethostname()[:30]}:{pid}:abcdef12"


def test_a_holder_that_exited_unreaped_is_gone_and_a_live_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not lease._is_zombie(child.pid) and not lease.holder_is_gone(owner_of(child.pid))
        child.stdin.close()  # it exits; not reaped yet, it is a zombie until wait()
        wait_until(lambda: lease._is_zombie(child.pid), timeout=30)
        assert lease.holder_is_gone(owner_of(child.pid))
    finally:
        child.wait(timeout=30)
    assert lease.holder_is_gone(owner_of(child.pid))  # reaped: no such process
    assert not lease.holder_is_gone(owner_of(os.getpid()))
    assert not lease.holder_is_gone(f"another-host:{child.pid}:abcdef12")  # only this host's pids are known
