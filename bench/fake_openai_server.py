"""A fake OpenAI-compatible streaming server with known timing: the truth a load generator is checked against.

Every completion (``POST /v1/completions``, ``POST /v1/chat/completions``) answers the way
llama-server does: the HTTP headers at once (status 200, ``text/event-stream``, chunked), then
exactly ``max_tokens`` chunks of one token each (the text ``" the"``, one token in the GPT-2, Llama
and SmolLM tokenizers), the first ``ttft`` seconds after the request arrived and the rest every
``itl`` seconds after it (each scheduled from the arrival, so late wake-ups do not add up), then a
final chunk with the finish reason, ``usage`` and ``timings`` (llama-server's fields), then
``data: [DONE]``. A non-streamed request gets one JSON body at the time its last token would have
been sent.

The server also records, per request, when it arrived and when its first and last tokens were
actually written (``GET /stats``, in seconds of this process's ``perf_counter``): the truth
against which a client's TTFT and ITL are judged, with the server's own lateness taken out.

Other endpoints: ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (llama-server's Prometheus
names; ``--no-metrics`` answers 501 as llama-server does without ``--metrics``), ``GET /count``
(requests arrived and completed, cheap to poll), ``POST /stats/reset``.

Faults, for tests: ``--fail-every K`` answers every K-th completion with HTTP 500;
``--no-finish`` ends every stream after its tokens with no finish reason and no ``[DONE]``;
``--no-usage`` leaves ``usage`` and ``timings`` out of the final chunk; ``--close-after-stream``
closes the connection after each stream with no ``Connection: close`` header, as llama-server does.
``--announce`` prints ``request N`` on stdout when the N-th completion arrives (so a test can wait
for a request to be in flight, a condition rather than a sleep).

    python bench/fake_openai_server.py --port 0 --ttft 0.05 --itl 0.01
    # prints "listening on http://127.0.0.1:PORT", serves until killed (SIGTERM/SIGINT)

Stdlib only; one thread per connection.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_TEXT = " the"


@dataclass
class FakeConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    fail_every: int = 0
    no_finish: bool = False
    no_usage: bool = False
    close_after_stream: bool = False
    announce: bool = False
    metrics: bool = True
    model: str = "fake-model"


@dataclass
class FakeState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    completed: int = 0  # completions whose last byte was written
    inflight: int = 0
    max_inflight: int = 0
    # one dict per completion: arrival, first and last token write (perf_counter), tokens, prompt tokens
    log: list[dict] = field(default_factory=list)
    prompt_tokens_total: int = 0
    tokens_predicted_total: int = 0

    def reset(self) -> None:
        with self.lock:
            self.requests = self.max_inflight = self.completed = 0
            self.log = []
            self.prompt_tokens_total = self.tokens_predicted_total = 0


def prompt_length(body: dict) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(str(p).split()) for p in prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages") or []
    words = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words += len(content.split())
        elif isinstance(content, list):
            words += sum(len(str(part.get("text", "")).split()) for part in content if isinstance(part, dict))
    return words


def wait_until(target: float) -> None:
    """Sleep until perf_counter() reaches target (the server's schedule, not a test's synchronisation)."""
    delay = target - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass

    # -- plumbing
    def _send_json(self, status: int, data: dict | list, extra_headers: dict | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra_headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain; version=0.0.4") -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _read_body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return {}

    # -- endpoints
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        cfg, state = self.server.config, self.server.state
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": [
                {"id": cfg.model, "object": "model", "created": 0, "owned_by": "fake"}]})
        elif self.path == "/metrics":
            if not cfg.metrics:
                self._send_json(501, {"error": {"code": 501, "message": "metrics disabled"}})
                return
            with state.lock:
                lines = [
                    "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed",
                    "# TYPE llamacpp:prompt_tokens_total counter",
                    f"llamacpp:prompt_tokens_total {state.prompt_tokens_total}",
                    "# TYPE llamacpp:tokens_predicted_total counter",
                    f"llamacpp:tokens_predicted_total {state.tokens_predicted_total}",
                    "# TYPE llamacpp:requests_processing gauge",
                    f"llamacpp:requests_processing {state.inflight}",
                    "# TYPE llamacpp:requests_deferred gauge",
                    "llamacpp:requests_deferred 0",
                    'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 0',
                ]
            self._send_text(200, "\n".join(lines) + "\n")
        elif self.path == "/count":
            with state.lock:
                data = {"requests": state.requests, "completed": state.completed, "inflight": state.inflight}
            self._send_json(200, data)
        elif self.path == "/stats":
            with state.lock:
                data = {"requests": state.requests, "inflight": state.inflight,
                        "max_inflight": state.max_inflight, "log": list(state.log),
                        "ttft_s": cfg.ttft_s, "itl_s": cfg.itl_s}
            self._send_json(200, data)
        else:
            self._send_json(404, {"error": {"code": 404, "message": f"no {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        arrived = time.perf_counter()
        body = self._read_body()
        if self.path == "/stats/reset":
            self.server.state.reset()
            self._send_json(200, {"ok": True})
            return
        chat = self.path in ("/v1/chat/completions", "/chat/completions")
        if not chat and self.path not in ("/v1/completions", "/completions"):
            self._send_json(404, {"error": {"code": 404, "message": f"no {self.path}"}})
            return
        self._complete(body, chat, arrived)

    def _complete(self, body: dict, chat: bool, arrived: float) -> None:
        cfg, state = self.server.config, self.server.state
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        n_prompt = prompt_length(body)
        with state.lock:
            state.requests += 1
            number = state.requests
        if cfg.fail_every and number % cfg.fail_every == 0:
            self._send_json(500, {"error": {"code": 500, "message": "injected failure", "type": "server_error"}})
            return
        entry = {"n": number, "arrived": arrived, "first": None, "last": None, "tokens": 0, "prompt": n_prompt,
                 "options": {k: body.get(k) for k in ("ignore_eos", "temperature", "stream", "max_tokens", "model")}}
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            entry.update(prompt_min=min(prompt), prompt_max=max(prompt), prompt_hash=hash(tuple(prompt)))
        with state.lock:
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)
            state.log.append(entry)
        if cfg.announce:  # once it counts as in flight
            print(f"request {number}", flush=True)
        try:
            if body.get("stream"):
                self._stream(entry, n, n_prompt, chat, arrived)
            else:
                wait_until(arrived + cfg.ttft_s + (n - 1) * cfg.itl_s)
                entry["first"] = entry["last"] = time.perf_counter()
                entry["tokens"] = n
                self._send_json(200, self._final(n, n_prompt, chat, TOKEN_TEXT * n, stream=False))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with state.lock:
                state.inflight -= 1
                state.completed += 1
                state.prompt_tokens_total += n_prompt
                state.tokens_predicted_total += entry["tokens"]

    def _final(self, n: int, n_prompt: int, chat: bool, text: str, stream: bool) -> dict:
        cfg = self.server.config
        if chat:
            key = "delta" if stream else "message"
            choice = {"index": 0, key: ({} if stream else {"role": "assistant", "content": text}),
                      "finish_reason": "length"}
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            choice = {"text": "" if stream else text, "index": 0, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        out = {"choices": [choice], "created": int(time.time()), "model": cfg.model, "object": obj, "id": "cmpl-fake"}
        if not cfg.no_usage:
            out["usage"] = {"completion_tokens": n, "prompt_tokens": n_prompt, "total_tokens": n + n_prompt}
            out["timings"] = {"prompt_n": n_prompt, "prompt_ms": cfg.ttft_s * 1000, "predicted_n": n,
                              "predicted_ms": cfg.itl_s * 1000 * max(n - 1, 0)}
        return out

    def _stream(self, entry: dict, n: int, n_prompt: int, chat: bool, arrived: float) -> None:
        cfg = self.server.config
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()
        if chat:
            piece = {"choices": [{"index": 0, "delta": {"content": TOKEN_TEXT}, "finish_reason": None}],
                     "object": "chat.completion.chunk", "model": cfg.model, "id": "chatcmpl-fake", "created": 0}
        else:
            piece = {"choices": [{"text": TOKEN_TEXT, "index": 0, "logprobs": None, "finish_reason": None}],
                     "object": "text_completion", "model": cfg.model, "id": "cmpl-fake", "created": 0}
        event = b"data: " + json.dumps(piece).encode() + b"\n\n"
        for i in range(n):
            wait_until(arrived + cfg.ttft_s + i * cfg.itl_s)
            self._chunk(event)
            now = time.perf_counter()
            if i == 0:
                entry["first"] = now
            entry["last"] = now
            entry["tokens"] = i + 1
        if not cfg.no_finish:
            final = self._final(n, n_prompt, chat, "", stream=True)
            self._chunk(b"data: " + json.dumps(final).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        if cfg.no_finish or cfg.close_after_stream:
            self.close_connection = True


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512

    def __init__(self, host: str = "127.0.0.1", port: int = 0, config: FakeConfig | None = None) -> None:
        super().__init__((host, port), Handler)
        self.config = config or FakeConfig()
        self.state = FakeState()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def summary(log: list[dict]) -> dict:
    """The server-side truth over completed streams: mean TTFT and ITL as actually written."""
    done = [e for e in log if e["first"] is not None and e["tokens"] > 1]
    if not done:
        return {"requests": 0}
    ttfts = [e["first"] - e["arrived"] for e in done]
    itls = [(e["last"] - e["first"]) / (e["tokens"] - 1) for e in done]
    return {"requests": len(done), "ttft_mean_s": sum(ttfts) / len(ttfts), "itl_mean_s": sum(itls) / len(itls)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds from arrival to the first token")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds between tokens")
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--no-finish", action="store_true")
    parser.add_argument("--no-usage", action="store_true", help="no usage or timings in the final chunk")
    parser.add_argument("--close-after-stream", action="store_true",
                        help="close the connection after each stream without saying so (llama-server does)")
    parser.add_argument("--announce", action="store_true")
    parser.add_argument("--no-metrics", action="store_true")
    parser.add_argument("--model", default="fake-model")
    args = parser.parse_args(argv)
    config = FakeConfig(ttft_s=args.ttft, itl_s=args.itl, fail_every=args.fail_every, no_finish=args.no_finish,
                        no_usage=args.no_usage, close_after_stream=args.close_after_stream,
                        announce=args.announce, metrics=not args.no_metrics, model=args.model)
    server = FakeServer(args.host, args.port, config)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"listening on {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
