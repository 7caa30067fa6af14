"""The load loop of a served trial: a stated workload sent to an OpenAI-compatible server, every request timed.

``run_load(base_url, spec)`` sends streamed completions (``POST /v1/completions``) to llama-server
(or anything that streams the same way) and returns one ``RequestRecord`` per request; the figures
and the SLO verdict are workers/slo.py's. Stdlib only (it runs on every worker node), threads over
``http.client``, one keep-alive connection per user.

Rules (numbered as the code cites them):

1. The workload. Prompts are random token ids drawn from ``[100, vocab_size - 100)`` (clear of the
   special tokens at both ends of a vocabulary), a fresh sequence per request from one seeded
   generator, so no two prompts share a prefix and the server's prompt cache never hits. Lengths
   are uniform in ``[prompt_tokens - prompt_spread, prompt_tokens + prompt_spread]``. Every request
   asks for exactly ``gen_tokens`` (``"ignore_eos": true``, ``"temperature": 0``), llama-server's
   own options (tools/server: a token-id list is one prompt; ``ignore_eos`` is a sampling
   parameter).
2. Arrivals. Closed loop (``concurrency=N``): N users, each sends its next request when its last one
   ends. Open loop (``rate=R``): requests arrive as a Poisson process at R per second (exponential
   gaps from the seeded generator, the first at time 0), each sent at its arrival whatever is in
   flight; a dispatcher hands each to an idle sender thread, starting a new one when none is idle.
3. Warm-up. The first ``warmup_requests`` requests (default: one per user, or 2 in an open loop) are
   recorded with ``warmup=True``; ``max_requests`` more are measured.
4. Bounds. No request is sent after ``max_s`` seconds from the start; at ``max_s`` the requests still
   in flight are cut (their sockets shut) and recorded as errors ``cut at the time bound``. A request
   that takes longer than ``request_timeout_s`` in all is an error ``timed out after ...``.
5. Timing (``time.perf_counter``, AIPerf's definitions). A request's clock starts just before its
   bytes are written (the prompt is drawn and encoded before). TTFT ends at the first chunk that
   carries generated text; e2e at the last one (llama-server sends its final chunk, with the finish
   reason and ``usage``, right after the last token). ``gen_tokens`` is the server's own count
   (``usage.completion_tokens``, else ``timings.predicted_n``, both in llama-server's final chunk);
   without either, the chunks that carried text (llama-server sends one token per chunk).
6. Failures are records, never exceptions: an HTTP error status, a refused or reset connection, an
   ``error`` event in the stream, a stream that ends without a finish reason, a timeout. A
   keep-alive connection is checked before it is reused (readable while idle: the server closed
   it), and llama-server closes every connection after a streamed answer without saying so (no
   ``Connection: close``; cpp-httplib), so its next request opens a new one; a reused connection
   that fails before any byte of the answer arrived is retried once on a new one (as urllib3 does).
   Neither is counted as a failure.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import queue
import random
import select
import socket
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, fields

from workers.errors import BadInput
from workers.slo import RequestRecord

CUT = "cut at the time bound"
TOKEN_MARGIN = 100  # rule 1: ids kept this far from both ends of the vocabulary
OPEN_LOOP_WARMUP = 2
MAX_SENDERS = 1024  # open loop: at most this many requests in flight at once (then arrivals wait)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass(frozen=True)
class LoadSpec:
    """A stated workload: prompt and output lengths, the arrival process, warm-up and bounds."""

    prompt_tokens: int = 256  # mean prompt length in tokens
    prompt_spread: int = 0  # lengths uniform in [mean-spread, mean+spread]
    gen_tokens: int = 128  # every request generates exactly this many (ignore_eos)
    concurrency: int | None = 4  # closed loop: this many users, each sends its next request when the last ends
    rate: float | None = None  # open loop instead: Poisson arrivals at this many requests/s (concurrency None)
    max_requests: int = 64  # measured requests (warm-up not counted)
    max_s: float = 120.0  # the whole load, warm-up included, ends by then
    warmup_requests: int | None = None  # None: one per user (closed loop) or 2 (open loop)
    request_timeout_s: float = 60.0
    seed: int = 1
    vocab_size: int = 32000  # token ids are drawn from [100, vocab_size-100)

    def validate(self) -> None:
        """One BadInput line for a workload that cannot be run as stated."""
        for name in ("prompt_tokens", "prompt_spread", "gen_tokens", "max_requests", "seed", "vocab_size"):
            if not _is_int(getattr(self, name)):
                raise BadInput(f"load: {name} must be an integer, not {getattr(self, name)!r}")
        if (self.concurrency is None) == (self.rate is None):
            raise BadInput("load: give either concurrency (closed loop) or rate (open loop), not "
                           + ("both" if self.concurrency is not None else "neither"))
        if self.concurrency is not None and (not _is_int(self.concurrency) or self.concurrency < 1):
            raise BadInput(f"load: concurrency must be a whole number of users >= 1, not {self.concurrency!r}")
        if self.rate is not None and (not _is_number(self.rate) or self.rate <= 0):
            raise BadInput(f"load: rate must be a positive number of requests per second, not {self.rate!r}")
        if self.prompt_spread < 0:
            raise BadInput(f"load: prompt_spread must be >= 0, not {self.prompt_spread}")
        if self.prompt_tokens - self.prompt_spread < 1:
            raise BadInput(f"load: prompts of {self.prompt_tokens} +- {self.prompt_spread} tokens "
                           "would be empty; the shortest must be >= 1 token")
        if self.gen_tokens < 1:
            raise BadInput(f"load: gen_tokens must be >= 1, not {self.gen_tokens}")
        if self.max_requests < 1:
            raise BadInput(f"load: max_requests must be >= 1, not {self.max_requests}")
        if self.warmup_requests is not None and (not _is_int(self.warmup_requests) or self.warmup_requests < 0):
            raise BadInput(f"load: warmup_requests must be None or >= 0, not {self.warmup_requests!r}")
        for name in ("max_s", "request_timeout_s"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise BadInput(f"load: {name} must be a positive number of seconds, not {value!r}")
        if self.vocab_size <= 2 * TOKEN_MARGIN:
            raise BadInput(f"load: vocab_size {self.vocab_size} leaves no token ids in "
                           f"[{TOKEN_MARGIN}, vocab_size-{TOKEN_MARGIN})")

    @property
    def warmup(self) -> int:
        """Rule 3: how many warm-up requests come first."""
        if self.warmup_requests is not None:
            return self.warmup_requests
        return self.concurrency if self.concurrency is not None else OPEN_LOOP_WARMUP

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LoadSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class LoadResult:
    """Every request of one load, in the order they were sent."""

    records: list[RequestRecord]
    started_at: float  # unix time of the first request
    wall_s: float

    def to_dict(self) -> dict:
        return {"records": [r.to_dict() for r in self.records], "started_at": self.started_at,
                "wall_s": self.wall_s}

    @classmethod
    def from_dict(cls, data: dict) -> LoadResult:
        return cls([RequestRecord.from_dict(r) for r in data["records"]], float(data["started_at"]),
                   float(data["wall_s"]))


class _Target:
    """Where the requests go: host, port and path prefix of an http:// base URL."""

    def __init__(self, base_url: str) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise BadInput(f"load: base URL {base_url!r} is not http://HOST[:PORT]")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.prefix = parsed.path.rstrip("/")
        if self.prefix.endswith("/v1"):
            self.prefix = self.prefix[:-3]

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


class _Prompts:
    """Rule 1: each request's body, drawn from one seeded generator (one seed, one set of prompts)."""

    def __init__(self, spec: LoadSpec, model: str) -> None:
        self.spec, self.model = spec, model
        self.rng = random.Random(spec.seed)
        self.ids = range(TOKEN_MARGIN, spec.vocab_size - TOKEN_MARGIN)
        self.lock = threading.Lock()

    def next(self) -> tuple[int, bytes]:
        spec = self.spec
        with self.lock:
            n = spec.prompt_tokens
            if spec.prompt_spread:
                n = self.rng.randint(spec.prompt_tokens - spec.prompt_spread, spec.prompt_tokens + spec.prompt_spread)
            prompt = self.rng.choices(self.ids, k=n)
        body = {"model": self.model, "prompt": prompt, "max_tokens": spec.gen_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        return n, json.dumps(body, separators=(",", ":")).encode()


class _Run:
    """The shared state of one load: the clock, the counters, the records, the sockets to cut."""

    def __init__(self, base_url: str, spec: LoadSpec, model: str) -> None:
        self.target = _Target(base_url)
        self.spec = spec
        self.prompts = _Prompts(spec, model)
        self.total = spec.warmup + spec.max_requests
        self.lock = threading.Lock()
        self.issued = 0
        self.records: list[tuple[int, RequestRecord]] = []
        self.stop = threading.Event()
        self.open_socks: set[socket.socket] = set()
        self.t0 = 0.0
        self.deadline = 0.0

    def take(self) -> int | None:
        """The next request's number, or None when the load is over (rule 4: count and time)."""
        with self.lock:
            if self.stop.is_set() or self.issued >= self.total or time.perf_counter() >= self.deadline:
                return None
            self.issued += 1
            return self.issued - 1

    def add(self, index: int, record: RequestRecord) -> None:
        with self.lock:
            self.records.append((index, record))

    def cut_all(self) -> None:
        """Rule 4: the time bound is reached; shut every socket still reading."""
        self.stop.set()
        with self.lock:
            socks = list(self.open_socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Sender:
    """One keep-alive connection that sends requests and times their streams (rules 5 and 6)."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.conn: http.client.HTTPConnection | None = None

    def _register(self, sock: socket.socket | None, add: bool) -> None:
        if sock is None:
            return
        with self.run.lock:
            if add:
                self.run.open_socks.add(sock)
            else:
                self.run.open_socks.discard(sock)

    def one(self, index: int, users: int | None) -> None:
        run, spec = self.run, self.run.spec
        n_prompt, body = run.prompts.next()
        start = time.perf_counter()
        first, last, tokens, error = self._send(body, start)
        run.add(index, RequestRecord(
            start_s=start - run.t0, prompt_tokens=n_prompt, gen_tokens=tokens,
            ttft_s=None if first is None else first - start, e2e_s=None if last is None else last - start,
            error=error, warmup=index < spec.warmup, users=users))

    def _send(self, body: bytes, start: float) -> tuple[float | None, float | None, int, str | None]:
        """(first token's time, last token's time, tokens, error) of one request; never raises."""
        run, spec = self.run, self.run.spec
        limit = min(start + spec.request_timeout_s, run.deadline)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        path = run.target.prefix + "/v1/completions"
        for attempt in (0, 1):
            if self.conn is not None and (self.conn.sock is None or connection_dropped(self.conn.sock)):
                self.close()  # rule 6: llama-server closes a connection after each stream
            fresh = self.conn is None
            try:
                if fresh:
                    self.conn = run.target.connection(max(limit - time.perf_counter(), 1e-3))
                    self.conn.connect()
                    self._register(self.conn.sock, True)
                else:
                    self.conn.sock.settimeout(max(limit - time.perf_counter(), 1e-3))
                self.conn.request("POST", path, body, headers)
                response = self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if not fresh and attempt == 0 and not run.stop.is_set():
                    continue  # rule 6: a keep-alive connection the server had closed
                return None, None, 0, self._why(exc)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                return None, None, 0, self._why(exc)
            break
        try:
            return self._read(response, limit)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            return None, None, 0, self._why(exc)

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self.conn is not None:
            self._register(self.conn.sock, False)
            self.conn.close()
            self.conn = None

    def _why(self, exc: BaseException) -> str:
        if self.run.stop.is_set():
            return CUT
        if isinstance(exc, TimeoutError):
            if time.perf_counter() >= self.run.deadline - 1e-3:
                return CUT
            return f"timed out after {self.run.spec.request_timeout_s:g} s"
        if isinstance(exc, ConnectionRefusedError):
            return "connection refused"
        return f"{type(exc).__name__}: {str(exc) or 'no detail'}"[:200]

    def _read(self, response: http.client.HTTPResponse,
              limit: float) -> tuple[float | None, float | None, int, str | None]:
        if response.status != 200:
            text = response.read().decode(errors="replace")
            if response.will_close:
                self.close()
            return None, None, 0, f"HTTP {response.status}: {_error_text(text)}"[:200]
        sock = self.conn.sock
        first = last = None
        chunks = 0
        finish = None
        count: int | None = None
        pending = b""
        done = False
        while not done:
            now = time.perf_counter()
            if now >= limit:
                raise TimeoutError
            sock.settimeout(limit - now)
            data = response.read1(65536)
            stamp = time.perf_counter()
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # a blank separator, an SSE comment (llama-server's ping ":"), an event name
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    self.close()
                    return first, last, chunks, f"server error: {_error_text(json.dumps(event))}"[:200]
                choices = event.get("choices") or []
                choice = choices[0] if choices and isinstance(choices[0], dict) else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    chunks += 1
                    if first is None:
                        first = stamp
                    last = stamp
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                usage = event.get("usage") or {}
                timings = event.get("timings") or {}
                if _is_int(usage.get("completion_tokens")):
                    count = usage["completion_tokens"]
                elif count is None and _is_int(timings.get("predicted_n")):
                    count = timings["predicted_n"]
        if not done and self.run.stop.is_set():
            raise ConnectionAbortedError(CUT)
        if done:
            try:  # the terminating chunk, so the connection can be reused; a server that holds it open loses it
                sock.settimeout(max(min(limit - time.perf_counter(), 1.0), 1e-3))
                response.read()
            except (OSError, http.client.HTTPException):
                self.close()
        if self.conn is not None and (response.will_close or not response.isclosed()):
            self.close()
        if finish is None:
            return first, last, chunks, f"stream ended without a finish reason after {chunks} chunk(s)"
        if first is None:
            return None, None, count or 0, "no generated text in the stream"
        return first, last, count if count is not None else chunks, None


def connection_dropped(sock: socket.socket) -> bool:
    """Whether the server closed this idle keep-alive connection (readable at once means EOF or
    unsolicited bytes: either way it cannot carry the next request), as urllib3 checks."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _error_text(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return " ".join(text.split())
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return " ".join(text.split())


def _closed_user(run: _Run, users: int) -> None:
    sender = _Sender(run)
    try:
        while (index := run.take()) is not None:
            sender.one(index, users)
    finally:
        sender.close()


class _OpenLoop:
    """Rule 2's open loop: a dispatcher at Poisson arrival times, a growing pool of sender threads."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.idle = 0  # senders free for a job (taken off when a job is handed out, not when it is taken)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def _worker(self) -> None:
        sender = _Sender(self.run)
        try:
            while (index := self.jobs.get()) is not None:
                sender.one(index, None)
                with self.lock:
                    self.idle += 1
        finally:
            sender.close()

    def _spawn(self, idle: bool) -> None:
        thread = threading.Thread(target=self._worker, daemon=True, name=f"loadgen-sender-{len(self.threads)}")
        if idle:
            with self.lock:
                self.idle += 1
        self.threads.append(thread)
        thread.start()

    def dispatch(self) -> None:
        run, spec = self.run, self.run.spec
        gaps = random.Random(spec.seed + 1_000_003)
        for _ in range(min(8, run.total)):
            self._spawn(idle=True)
        due = run.t0
        try:
            while due < run.deadline:
                wait = due - time.perf_counter()
                if wait > 0 and run.stop.wait(wait):
                    return
                index = run.take()
                if index is None:
                    return
                with self.lock:
                    grow = self.idle <= 0 and len(self.threads) < MAX_SENDERS
                    if not grow:
                        self.idle -= 1  # below 0: jobs waiting for a sender (MAX_SENDERS in flight)
                if grow:
                    self._spawn(idle=False)
                self.jobs.put(index)
                due += gaps.expovariate(spec.rate)
        finally:
            for _ in self.threads:
                self.jobs.put(None)


def run_load(base_url: str, spec: LoadSpec, model: str = "model") -> LoadResult:
    """Send the workload ``spec`` to the server at ``base_url`` (``http://127.0.0.1:8080``) and time
    every request (rules 1-6). Returns when every request has ended or been cut at ``spec.max_s``."""
    spec.validate()
    run = _Run(base_url, spec, model)
    run.t0 = time.perf_counter()
    started_at = time.time()
    run.deadline = run.t0 + spec.max_s
    if spec.concurrency is not None:
        threads = [threading.Thread(target=_closed_user, args=(run, spec.concurrency), daemon=True,
                                    name=f"loadgen-user-{i}") for i in range(spec.concurrency)]
        open_loop = None
    else:
        open_loop = _OpenLoop(run)
        threads = [threading.Thread(target=open_loop.dispatch, daemon=True, name="loadgen-dispatch")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(run.deadline - time.perf_counter(), 0))
    if open_loop is not None:
        for thread in list(open_loop.threads):
            thread.join(max(run.deadline - time.perf_counter(), 0))
        threads = threads + open_loop.threads
    if any(t.is_alive() for t in threads):
        run.cut_all()
        for thread in threads:
            thread.join(5.0)  # a shut socket wakes its reader at once
    wall = time.perf_counter() - run.t0
    with run.lock:
        records = [record for _, record in sorted(run.records, key=lambda item: item[0])]
    return LoadResult(records=records, started_at=started_at, wall_s=wall)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``name`` (with its ``{labels}``, if any) -> value."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            name, _, rest = line.rpartition("}")
            name += "}"
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            out[name.strip()] = float(parts[0])
        except ValueError:
            continue
    return out


def scrape_metrics(base_url: str, timeout_s: float = 5) -> dict[str, float]:
    """llama-server's Prometheus ``/metrics`` (started with ``--metrics``) as name -> value; {} when
    the server has no metrics endpoint (llama-server answers 501 without ``--metrics``) or cannot be
    reached."""
    target = _Target(base_url)
    conn = target.connection(timeout_s)
    try:
        conn.request("GET", target.prefix + "/metrics")
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        if response.status != 200:
            return {}
    except (OSError, http.client.HTTPException):
        return {}
    finally:
        conn.close()
    return parse_prometheus(text)
