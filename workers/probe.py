"""Served-traffic probe: a fixed prompt set sent to a node's own server through its OpenAI API.

Runs on the node (a Ray task pinned to it) against the server on the node's loopback address, so
the canary analysis measures what clients get. Each sample is two plain completions of two prompts
of the same length: one of a single token (its time is the time to first token: the prompt
processed and one token made) and one of the workload's generated tokens (its time is the whole
request); the server's own ``usage`` counts the tokens. Prompt rate: prompt tokens over the time to
first token; generation rate: the tokens after the first over the rest of the time. (Streamed
completions were tried first: llama-cpp-python 0.3.36 ends a stream after its first chunk for these
prompts while the same request unstreamed generates every token, so streaming cannot count tokens
here.)

The two prompts differ from their first digit on: both servers keep the last request's tokens and
reuse the longest common prefix, so the full request of the SAME prompt would skip the prompt (its
time then shorter than the one-token request's, or not, depending on whether another client's
request came in between: the largest noise in the first served canaries).

Two summaries: medians (what a client got) and service figures from the fastest sample of each
kind (waiting behind other clients' requests only adds time, but on a shared CPU a lucky moment also
takes some away). The canary analysis judges on the median of the samples' own rates
(orchestrator.canary.sample_rates), for which each sample's timings are returned too.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

DIGITS = 5
TOKENS_PER_NUMBER = DIGITS + 2  # SmolLM2's and Llama's tokenizers: one token per digit, ",", " "


def prompt_of(n_tokens: int, seed: int) -> str:
    """A fixed prompt of about ``n_tokens`` tokens: a count ("10001, 10002,"), which a model goes on
    counting rather than stopping early. Every seed's numbers have the same number of digits (so
    the same length) and a different second digit (so no two share more than one token)."""
    start = 10 ** (DIGITS - 1) + 1000 * (seed % 90)
    return ", ".join(str(start + i) for i in range(max(1, n_tokens // TOKENS_PER_NUMBER))) + ","


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


def complete(address: str, model: str, prompts: tuple[str, str], n_gen: int, timeout_s: float = 120
             ) -> RequestResult:
    """One sample: a one-token request of the first prompt, then the full one of the second (same
    length; no shared prefix for the server to reuse); its timings, or why it failed."""
    body = {"model": model, "temperature": 0.0, "seed": 1, "cache_prompt": False}
    try:
        first_s, _ = _post(address, {**body, "prompt": prompts[0], "max_tokens": 1}, timeout_s)
        total_s, full = _post(address, {**body, "prompt": prompts[1], "max_tokens": max(1, n_gen)}, timeout_s)
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
        out.update(service_figures(good, n_prompt))
    out["failures"] = [r.error for r in results if not r.ok][:3]
    return out


def service_figures(good: list[RequestResult], n_prompt: int) -> dict:
    """The server's own speed: rates from the fastest one-token request and the fastest full one
    (queueing and CPU contention only add time). ``best_tg_tps`` is None when the difference of
    the two is not positive (too few generated tokens to see past the noise)."""
    ttft = min(r.ttft_s for r in good)
    total = min(r.total_s for r in good)
    n_gen = min(r.n_gen for r in good)
    if max(r.n_gen for r in good) <= 1:  # both requests were one-token ones: two prompt timings
        ttft = total = min(ttft, total)
    prompt = statistics.median(r.n_prompt or n_prompt for r in good)
    return {"best_ttft_s": ttft, "best_total_s": total, "best_pp_tps": prompt / ttft,
            "best_tg_tps": (n_gen - 1) / (total - ttft) if n_gen > 1 and total > ttft else None}


def probe(address: str, model: str, n_prompt: int, n_gen: int, n_requests: int, deadline_s: float = 300,
          first: int = 0) -> dict:
    """``n_requests`` samples (bounded in count and time) of the workload, the prompts numbered from
    ``first`` (each sample uses two); their summary."""
    results = []
    stop = time.monotonic() + deadline_s
    for i in range(first, first + n_requests):
        if time.monotonic() > stop:
            break
        results.append(complete(address, model, (prompt_of(n_prompt, 2 * i), prompt_of(n_prompt, 2 * i + 1)),
                                max(1, n_gen)))
    summary = summarise(results, n_prompt)
    summary["results"] = [asdict(r) for r in results]
    return summary
