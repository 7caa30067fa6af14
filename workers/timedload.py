"""Closed-loop load for a stated time, every request let finish: the canary analysis's rounds.

``run_for(base_url, spec, duration_s)`` keeps ``spec.concurrency`` users busy for ``duration_s``
seconds: each user sends one streamed request after another (``workers.loadgen.run_load`` of one
request, so the prompts, the timing and the failures are loadgen's rules 1, 5 and 6), and no user
starts a request after ``duration_s``. Unlike ``LoadSpec.max_s``, which cuts the requests still in
flight at its bound (errors), a request started in time runs to its end (within
``spec.request_timeout_s``): a canary judged on its error share must not be given failures that
the load made. Several nodes loaded for the same ``duration_s`` at the same moment are loaded over
the same stretch of time, and none sits idle while another finishes a fixed count of requests (an
Apple GPU idle for more than about 1.2 s is reported to take about 5x longer for its next tokens).

Rules:

1. Request ``k`` of the load (in the order they are sent, all users together) draws its prompt from
   the seed ``spec.seed * SEED_STRIDE + k``: no two requests of one load, or of loads with
   different seeds, share a prompt.
2. The first ``spec.warmup`` requests are recorded with ``warmup=True`` (loadgen's rule 3).
3. Every record's ``start_s`` is relative to the start of this load.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from workers.loadgen import LoadResult, LoadSpec, run_load
from workers.slo import RequestRecord

SEED_STRIDE = 1_000_003  # rule 1: seeds of different loads never meet (fewer requests than this per load)


def run_for(base_url: str, spec: LoadSpec, duration_s: float, model: str = "model") -> LoadResult:
    """``spec.concurrency`` closed-loop users for ``duration_s`` seconds (rules 1-3); returns when
    the last request started in time has ended. ``spec.max_requests`` bounds the requests sent."""
    spec.validate()
    if spec.concurrency is None:
        raise ValueError("run_for runs closed-loop users: give spec.concurrency, not a rate")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, not {duration_s!r}")
    lock = threading.Lock()
    taken: list[int] = [0]
    records: list[tuple[int, RequestRecord]] = []
    one = dataclasses.replace(spec, concurrency=1, max_requests=1, warmup_requests=0,
                              max_s=spec.request_timeout_s + 1.0)  # the request's own timeout bounds it
    t0 = time.perf_counter()
    started_at = time.time()
    stop_at = t0 + duration_s

    def next_index() -> int | None:
        with lock:
            if time.perf_counter() >= stop_at or taken[0] >= spec.warmup + spec.max_requests:
                return None
            taken[0] += 1
            return taken[0] - 1

    def user() -> None:
        while (k := next_index()) is not None:
            sent = time.perf_counter()
            result = run_load(base_url, dataclasses.replace(one, seed=spec.seed * SEED_STRIDE + k), model)
            for record in result.records:
                with lock:
                    records.append((k, dataclasses.replace(record, start_s=sent - t0 + record.start_s,
                                                           warmup=k < spec.warmup, users=spec.concurrency)))

    threads = [threading.Thread(target=user, daemon=True, name=f"timedload-user-{i}") for i in range(spec.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # each request ends within its own timeout (loadgen's rule 4)
    with lock:
        ordered = [record for _, record in sorted(records, key=lambda item: item[0])]
    return LoadResult(records=ordered, started_at=started_at, wall_s=time.perf_counter() - t0)
