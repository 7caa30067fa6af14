"""Served-traffic probe: a fixed prompt set sent to a node's own server through its OpenAI API.

Runs on the node (a Ray task pinned to it) against the server on the node's loopback address, so
the canary analysis measures what clients get. Each sample is two plain completions of the same
prompt: one of a single token (its time is the time to first token: the prompt processed and one
token made) and one of the workload's generated tokens (its time is the whole request); the
server's own ``usage`` counts the tokens. Prompt rate: prompt tokens over the time to first token;
generation rate: the tokens after the first over the rest of the time. (Streamed completions were
tried first: llama-cpp-python 0.3.36 ends a stream after its first chunk for these prompts while the
same request unstreamed generates every token, so streaming cannot count tokens here.)
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
    on counting rather than stopping early (a 3-digit number, its comma and space: about 5 tokens)."""
    start = 100 * (seed + 1)
    return ", ".join(str(start + i) for i in range(max(1, n_tokens // 5))) + ","


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    total_s: float | None = None
    n_gen: int = 0
    n_prompt: int = 0
    error: str | None = None


def _post(address: str, body: dict, timeout_s: float) -> tuple[float, dict]:
    url = urlparse(address)
    started = time.perf_counter()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("POST", url.path.rstrip("/") + "/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise http.client.HTTPException(f"HTTP {response.status}: {data[:200]!r}")
        return time.perf_counter() - started, json.loads(data)
    finally:
        conn.close()


def complete(address: str, model: str, prompt: str, n_gen: int, timeout_s: float = 120) -> RequestResult:
    """One sample (a one-token request, then the full one); its timings, or why it failed."""
    body = {"model": model, "prompt": prompt, "temperature": 0.0, "seed": 1}
    try:
        first_s, _ = _post(address, {**body, "max_tokens": 1}, timeout_s)
        total_s, full = _post(address, {**body, "max_tokens": max(1, n_gen)}, timeout_s)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    usage = full.get("usage") or {}
    return RequestResult(True, ttft_s=first_s, total_s=total_s, n_gen=int(usage.get("completion_tokens", 0)),
                         n_prompt=int(usage.get("prompt_tokens", 0)))


def summarise(results: list[RequestResult], n_prompt: int) -> dict:
    """Medians over the successful requests: pp and tg rates, time to first token; the error rate."""
    good = [r for r in results if r.ok]
    out = {"requests": len(results), "errors": len(results) - len(good),
           "error_rate": (len(results) - len(good)) / len(results) if results else 1.0,
           "ttft_s": None, "pp_tps": None, "tg_tps": None, "n_gen": None}
    if good:
        out["ttft_s"] = statistics.median(r.ttft_s for r in good)
        out["pp_tps"] = statistics.median((r.n_prompt or n_prompt) / r.ttft_s for r in good)
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
