"""Who drives a study: the lease's owner identity, and whether a holder is provably gone.

A running study is held by one driver at a time (``ft_studies.lease_owner`` with a heartbeat the
study loop refreshes in every round's transaction). A second driver is refused while the heartbeat
is fresh. A holder on this host whose process no longer exists is gone at once, so ``--resume``
after a killed driver need not wait for the heartbeat to go stale; a holder on another host is
gone only when its heartbeat is older than the lease's time to live.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from datetime import UTC, datetime, timedelta

LEASE_TTL_S = float(os.environ.get("FLEETTUNE_LEASE_TTL_S", "60"))  # stale after this long silent
HEARTBEAT_S = min(10.0, LEASE_TTL_S / 4)  # a waiting loop refreshes its lease this often


def new_owner() -> str:
    """This driver's identity: host, process id and a random part (pids are reused)."""
    return f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def describe(owner: str) -> str:
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    return f"pid {pid} on {host}" if pid else owner


def holder_is_gone(owner: str) -> bool:
    """True when ``owner`` ran on this host and its process no longer exists."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname()[:30] or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False  # another runner of this same process (an earlier, abandoned one)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped, as POSIX ``ps`` tells it: the same call on
    macOS (the fleet's OS, which has no /proc) and Linux (rule 21.5). Unknown counts as alive."""
    try:
        done = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.strip().startswith("Z")


def stale_before(now: datetime | None = None) -> datetime:
    return (now or datetime.now(UTC)) - timedelta(seconds=LEASE_TTL_S)
