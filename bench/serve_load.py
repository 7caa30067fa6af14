"""A bounded request loop against serving nodes: what the rollout tests and benchmarks put on them.

One ``openai`` client per server, 8-token completions in turn, at most ``max_requests`` requests
and ``max_s`` seconds; every failure is counted with its cause, never raised, so a caller can
assert that none happened (a rollout must drop no request).
"""

from __future__ import annotations

import threading
import time


class RoundRobinLoop:
    """Requests to each server in turn from a background thread, until stopped or bounded out."""

    def __init__(self, statuses: list[dict], max_requests: int = 2000, max_s: float = 900) -> None:
        from openai import OpenAI  # a test dependency, not one of fleettune's own

        self.clients = [(OpenAI(base_url=s["address"], api_key="none", max_retries=0, timeout=120), s["model"])
                        for s in statuses]
        self.max_requests, self.deadline = max_requests, time.monotonic() + max_s
        self.ok, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for i in range(self.max_requests):
            if self._stop.is_set() or time.monotonic() > self.deadline:
                return
            client, model = self.clients[i % len(self.clients)]
            try:
                client.completions.create(model=model, prompt=f"Request {i}: the weather today is",
                                          max_tokens=8, temperature=0)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                self.failures.append(f"{type(exc).__name__}: {exc} ({exc.__cause__!r})")

    def __enter__(self) -> RoundRobinLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)
