"""A bounded request loop against serving nodes: what the rollout tests and benchmarks put on them.

``clients`` threads send 8-token completions to each server in turn, at most ``max_requests``
requests in all and ``max_s`` seconds; with ``streamed`` every other request is streamed and must
end with a finish reason (a stream the server cut short is a failure, as llama-cpp-python's
``interrupt_requests`` does to a running stream when another request arrives). Every failure is
counted with its cause, never raised, so a caller can assert that none happened (a rollout must
drop no request, and no request may cut another: rule 2 of issue 24).
"""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import threading
import time


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``; waited for either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


def port_free(port: int) -> bool:
    """True when nothing listens on (or holds) this loopback port: it can be bound now."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


class RoundRobinLoop:
    """Requests to each server in turn from background threads, until stopped or bounded out."""

    def __init__(self, statuses: list[dict], max_requests: int = 2000, max_s: float = 900, *,
                 clients: int = 1, streamed: bool = False, timeout_s: float = 120) -> None:
        from openai import OpenAI  # a test dependency, not one of fleettune's own

        self.clients = [(OpenAI(base_url=s["address"], api_key="none", max_retries=0, timeout=timeout_s), s["model"])
                        for s in statuses]
        self.max_requests, self.deadline, self.streamed = max_requests, time.monotonic() + max_s, streamed
        self.ok, self.streams_ok, self.failures = 0, 0, []
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _one(self, i: int) -> None:
        client, model = self.clients[i % len(self.clients)]
        prompt = f"Request {i}: the weather today is"
        if not (self.streamed and i % 2):
            client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            with self._lock:
                self.ok += 1
            return
        chunks, finish = 0, None
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                               stream=True):
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if finish is None:
            raise ConnectionAbortedError(f"stream cut: ended after {chunks} chunk(s) with no finish reason")
        with self._lock:
            self.ok += 1
            self.streams_ok += 1

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() <= self.deadline:
            i = next(self._numbers)
            if i >= self.max_requests:
                return
            try:
                self._one(i)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc} ({exc.__cause__!r})")

    def __enter__(self) -> RoundRobinLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
