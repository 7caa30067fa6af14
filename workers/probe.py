"""Served-traffic probe: a fixed prompt set sent to a node's own server through its OpenAI API.

Runs on the node (a Ray task pinned to it) against the server on the node's loopback address, so
the canary analysis measures what clients get: per request, time to first token, generated tokens
and the rates that follow (prompt tokens over time to first token, generated tokens after the
first over the rest of the time), and whether it failed. Streaming completions give the time to
first token; each streamed chunk is one generated token (llama-cpp-python and llama-server both
stream token by token).
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse


def prompt_of(n_tokens: int, seed: int) -> str:
    """A fixed prompt of about ``n_tokens`` tokens: a count ("101, 102, 103,"), which a model goes
    on counting rather than stopping early, so the requested tokens are generated (a number and
    its comma are about two tokens)."""
    start = 100 * (seed + 1)
    return ", ".join(str(start + i) for i in range(max(1, n_tokens // 2))) + ","


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    total_s: float | None = None
    n_gen: int = 0
    config_version: int | None = None
    error: str | None = None


def complete(address: str, model: str, prompt: str, n_gen: int, timeout_s: float = 120) -> RequestResult:
    """One streamed completion; its timings, or why it failed."""
    url = urlparse(address)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n_gen, "stream": True,
                       "temperature": 0.0, "seed": 1}).encode()
    started = time.perf_counter()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("POST", url.path.rstrip("/") + "/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return RequestResult(False, error=f"HTTP {response.status}: {response.read(200)!r}")
        first = None
        chunks = 0
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                chunks += 1
                first = first or time.perf_counter()
        total = time.perf_counter() - started
        if first is None:
            return RequestResult(False, total_s=total, error="no token came back")
        return RequestResult(True, ttft_s=first - started, total_s=total, n_gen=chunks)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def summarise(results: list[RequestResult], n_prompt: int) -> dict:
    """Medians over the successful requests: pp and tg rates, time to first token; the error rate."""
    good = [r for r in results if r.ok]
    out = {"requests": len(results), "errors": len(results) - len(good),
           "error_rate": (len(results) - len(good)) / len(results) if results else 1.0,
           "ttft_s": None, "pp_tps": None, "tg_tps": None, "n_gen": None}
    if good:
        out["ttft_s"] = statistics.median(r.ttft_s for r in good)
        out["pp_tps"] = statistics.median(n_prompt / r.ttft_s for r in good)
        tg = [(r.n_gen - 1) / (r.total_s - r.ttft_s) for r in good if r.n_gen > 1 and r.total_s > r.ttft_s]
        out["tg_tps"] = statistics.median(tg) if tg else None
        out["n_gen"] = statistics.median(r.n_gen for r in good)
    out["failures"] = [r.error for r in results if not r.ok][:3]
    return out


def probe(address: str, model: str, n_prompt: int, n_gen: int, n_requests: int, deadline_s: float = 300) -> dict:
    """``n_requests`` requests (bounded in count and time) of the workload; their summary."""
    results = []
    stop = time.monotonic() + deadline_s
    for i in range(n_requests):
        if time.monotonic() > stop:
            break
        results.append(complete(address, model, prompt_of(n_prompt, i), max(1, n_gen)))
    summary = summarise(results, n_prompt)
    summary["results"] = [asdict(r) for r in results]
    return summary
