"""Pausing studies on a signal: SIGINT, SIGTERM and SIGHUP ask every running study to pause.

The handler only sets a flag; each study loop looks at it between steps (at least every
``studies.POLL_S``), cancels its running trials, stores what it has collected and stops with
``StudyPaused`` (exit 3). Nothing is interrupted half-way through a bookkeeping step, which a
``KeyboardInterrupt`` raised at an arbitrary line could do. A second SIGINT while pausing raises
``KeyboardInterrupt`` for someone who really wants out at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PAUSE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """A thread-safe "please pause" shared by every study of one driver."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


@contextmanager
def pause_on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """Route SIGINT/SIGTERM/SIGHUP to ``stop`` for the duration of the block (main thread only;
    elsewhere the block runs with the process's handlers as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame) -> None:
        if signum == signal.SIGINT and stop:
            raise KeyboardInterrupt  # the second Ctrl-C: out now
        stop.request(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in PAUSE_SIGNALS}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
