"""workers/loadgen.py against a fake streaming server whose timing is known (bench/fake_openai_server.py).

Fast tier: no model, no llama.cpp. The fake server runs in its own process (as a real server does,
and so that it can be killed mid-load); every wait is on a condition with a deadline (a line on its
stdout, a thread's end), never a bare sleep.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.serve_load import stop_process
from workers.errors import BadInput
from workers.loadgen import (
    CUT,
    LoadResult,
    LoadSpec,
    connection_dropped,
    parse_prometheus,
    run_load,
    scrape_metrics,
)
from workers.slo import RequestRecord

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "bench" / "fake_openai_server.py"


class Fake:
    """One fake server process: its URL, its stdout lines, its /stats."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FAKE), "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.pending = b""  # read from the pipe, not yet split into lines (no buffered reader: select sees all)
        line = self.line_matching("listening on ", deadline_s=20)
        self.url = line.split("listening on ", 1)[1].strip()

    def line_matching(self, text: str, deadline_s: float) -> str:
        """The next stdout line containing ``text``, waiting at most ``deadline_s``."""
        end = time.monotonic() + deadline_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.pending:
                raw, self.pending = self.pending.split(b"\n", 1)
                line = raw.decode()
                if text in line:
                    return line
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the fake server printed no line with {text!r} in {deadline_s} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise AssertionError(f"the fake server exited (rc {self.proc.poll()}) before printing {text!r}")
                self.pending += data

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as response:
            return json.load(response)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc.stdout.close()


@pytest.fixture
def fake_server() -> Iterator:
    started: list[Fake] = []

    def start(*args: str) -> Fake:
        fake = Fake(*args)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def measured(result: LoadResult) -> list[RequestRecord]:
    return [r for r in result.records if not r.warmup]


def most_in_flight(records: list[RequestRecord]) -> int:
    """The most requests the client had open at once, from their own start and end times."""
    events = []
    for r in records:
        end = r.end_s if r.end_s is not None else r.start_s
        events += [(r.start_s, 1), (end, -1)]
    top = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        top = max(top, now)
    return top


def test_ttft_and_itl_are_the_servers_known_timing(fake_server):
    fake = fake_server("--ttft", "0.08", "--itl", "0.012")
    result = run_load(fake.url, LoadSpec(prompt_tokens=32, gen_tokens=16, concurrency=2, max_requests=8,
                                         max_s=30))
    records = measured(result)
    assert len(records) == 8 and all(r.ok for r in records), [r.error for r in records]
    assert all(r.gen_tokens == 16 for r in records)  # the server's own count (usage.completion_tokens)
    ttft = statistics.median(r.ttft_s for r in records)
    itl = statistics.median(r.itl_s for r in records)
    # against what the server actually wrote (on a loaded machine it writes late): a few ms at most
    log = fake.stats()["log"]
    truth_ttft = statistics.median(e["first"] - e["arrived"] for e in log)
    truth_itl = statistics.median((e["last"] - e["first"]) / (e["tokens"] - 1) for e in log)
    assert abs(ttft - truth_ttft) < 0.005, (ttft, truth_ttft)
    assert abs(itl - truth_itl) < 0.0005, (itl, truth_itl)
    # and the figures are the ones asked for: the first token, not the headers (sent at once, 0 ms)
    # nor the last (260 ms); the server's lateness is allowed for
    assert abs(ttft - 0.08) < 0.015, ttft
    assert abs(itl - 0.012) < 0.002, itl


def test_tokens_are_counted_from_the_chunks_when_the_server_gives_no_usage(fake_server):
    fake = fake_server("--ttft", "0.01", "--itl", "0.005", "--no-usage")
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=7, concurrency=1, max_requests=3))
    assert [r.gen_tokens for r in result.records] == [7] * 4 and all(r.ok for r in result.records)


def test_the_closed_loop_keeps_exactly_its_users_in_flight_and_its_request_bounds(fake_server):
    fake = fake_server("--ttft", "0.02", "--itl", "0.005")
    spec = LoadSpec(prompt_tokens=16, gen_tokens=8, concurrency=3, max_requests=9, max_s=30)
    result = run_load(fake.url, spec)
    assert len(result.records) == 12  # 3 warm-up (one per user) + 9 measured
    assert sum(r.warmup for r in result.records) == 3 and len(measured(result)) == 9
    assert all(r.ok and r.users == 3 for r in result.records)
    stats = fake.stats()
    assert stats["requests"] == 12
    assert stats["max_inflight"] == 3  # never more than 3 at the server, and the 3 did overlap
    assert most_in_flight(result.records) <= 3


def test_a_server_that_closes_after_each_stream_loses_no_request(fake_server):
    # llama-server (cpp-httplib) closes the connection after every streamed answer, saying nothing
    fake = fake_server("--ttft", "0.03", "--itl", "0.005", "--close-after-stream")
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=8, concurrency=2, max_requests=8))
    assert len(result.records) == 10 and all(r.ok for r in result.records), [r.error for r in result.records]
    log = fake.stats()["log"]
    assert len(log) == 10  # each request sent once
    # TTFT from the client's send, each on a new connection: the server's own 30 ms plus the
    # connect and the scheduling of a loaded machine (1-2.3 ms here beside the full suite); half the
    # server's TTFT still tells a clock started at the wrong moment (a whole request or more off)
    truth = statistics.median(e["first"] - e["arrived"] for e in log)
    assert abs(statistics.median(r.ttft_s for r in result.records) - truth) < 0.015


def test_a_connection_the_peer_closed_is_seen_before_it_is_reused():
    mine, peer = socket.socketpair()
    try:
        assert not connection_dropped(mine)  # idle and open
        peer.close()
        assert connection_dropped(mine)  # EOF waiting: the next request would fail on it
    finally:
        mine.close()


def test_warmup_requests_can_be_set(fake_server):
    fake = fake_server("--ttft", "0.005", "--itl", "0.002")
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=2, concurrency=2, max_requests=4,
                                         warmup_requests=0))
    assert len(result.records) == 4 and not any(r.warmup for r in result.records)


def test_the_open_loop_sends_poisson_arrivals_at_its_rate(fake_server):
    fake = fake_server("--ttft", "0.003", "--itl", "0.001")
    rate = 40.0  # gaps of 25 ms: a loaded 2-core machine's scheduling delays (a few ms) stay small beside them
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=2, concurrency=None, rate=rate,
                                         max_requests=200, max_s=30))
    assert len(result.records) == 202 and all(r.ok and r.users is None for r in result.records)
    arrivals = sorted(e["arrived"] for e in fake.stats()["log"])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) < 0.2 / rate, mean  # 201 exponential gaps: the mean's sd is 7 %
    # the shape from the client's own send times (the server's arrivals also carry its scheduling
    # jitter on a loaded machine): exponential gaps have a CV of 1, uniform ones 0.58, fixed ones 0
    sends = sorted(r.start_s for r in result.records)
    sent_gaps = [b - a for a, b in zip(sends, sends[1:], strict=False)]
    cv = statistics.stdev(sent_gaps) / statistics.fmean(sent_gaps)
    assert 0.75 < cv < 1.3, cv


def test_the_time_bound_cuts_requests_in_flight(fake_server):
    fake = fake_server("--ttft", "0.05", "--itl", "0.05")
    started = time.perf_counter()
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=1000, concurrency=2, max_requests=10,
                                         max_s=1.0))
    took = time.perf_counter() - started
    assert took < 2.5 and result.wall_s < 1.5, (took, result.wall_s)
    assert len(result.records) == 2  # each user's first request, 50 s long: both cut
    assert all(r.error == CUT for r in result.records)
    assert all(r.start_s < 1.0 for r in result.records)


def test_a_request_past_its_timeout_is_an_error(fake_server):
    fake = fake_server("--ttft", "2", "--itl", "0.01")
    result = run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=2, concurrency=1, max_requests=1,
                                         warmup_requests=0, request_timeout_s=0.3, max_s=20))
    assert [r.error for r in result.records] == ["timed out after 0.3 s"]
    assert result.wall_s < 1.5


def test_a_server_killed_mid_load_gives_error_records_and_run_load_returns(fake_server):
    fake = fake_server("--ttft", "0.01", "--itl", "0.02", "--announce")
    spec = LoadSpec(prompt_tokens=8, gen_tokens=200, concurrency=2, max_requests=6, max_s=60)
    out: dict = {}
    loader = threading.Thread(target=lambda: out.update(result=run_load(fake.url, spec)), daemon=True)
    loader.start()
    fake.line_matching("request 2", deadline_s=20)  # both users' first requests are in flight (4 s each)
    assert fake.stats()["inflight"] == 2
    os.kill(fake.proc.pid, signal.SIGKILL)
    fake.proc.wait(10)
    loader.join(30)
    assert not loader.is_alive(), "run_load did not return after its server died"
    records = out["result"].records
    assert len(records) == 8 and not any(r.ok for r in records)
    in_flight, after = records[:2], records[2:]  # (in the order sent)
    assert all(r.error and r.gen_tokens < 200 for r in in_flight), [r.error for r in in_flight]
    assert all(r.error and r.gen_tokens == 0 for r in after), [r.error for r in after]
    # once the process is gone nothing listens; a connect in the moment it dies may be reset instead
    assert sum(r.error == "connection refused" for r in after) >= 3, [r.error for r in after]


def test_http_errors_and_unfinished_streams_are_records(fake_server):
    failing = fake_server("--ttft", "0.005", "--itl", "0.002", "--fail-every", "2")
    result = run_load(failing.url, LoadSpec(prompt_tokens=8, gen_tokens=4, concurrency=1, max_requests=5))
    errors = [r.error for r in result.records]
    assert errors == [None, "HTTP 500: injected failure"] * 3, errors
    unfinished = fake_server("--ttft", "0.005", "--itl", "0.002", "--no-finish")
    result = run_load(unfinished.url, LoadSpec(prompt_tokens=8, gen_tokens=4, concurrency=1, max_requests=2))
    assert [r.error for r in result.records] == ["stream ended without a finish reason after 4 chunk(s)"] * 3


def test_prompts_are_distinct_random_token_ids_within_the_vocabulary(fake_server):
    fake = fake_server("--ttft", "0.003", "--itl", "0.001")
    spec = LoadSpec(prompt_tokens=40, prompt_spread=10, gen_tokens=3, concurrency=2, max_requests=20, vocab_size=500)
    result = run_load(fake.url, spec, model="smol")
    log = fake.stats()["log"]
    assert len(log) == 22
    lengths = [e["prompt"] for e in log]
    assert min(lengths) >= 30 and max(lengths) <= 50 and len(set(lengths)) > 3
    assert sorted(lengths) == sorted(r.prompt_tokens for r in result.records)
    assert min(e["prompt_min"] for e in log) >= 100 and max(e["prompt_max"] for e in log) < 400
    assert len({e["prompt_hash"] for e in log}) == 22  # no prompt repeats: no prompt-cache hit
    assert all(e["options"] == {"ignore_eos": True, "temperature": 0, "stream": True, "max_tokens": 3,
                                "model": "smol"} for e in log)


def test_the_same_seed_draws_the_same_prompts(fake_server):
    hashes = []
    for seed in (7, 7, 8):
        fake = fake_server("--ttft", "0.002", "--itl", "0.001")
        run_load(fake.url, LoadSpec(prompt_tokens=16, gen_tokens=2, concurrency=1, max_requests=3, seed=seed))
        hashes.append([e["prompt_hash"] for e in fake.stats()["log"]])
    assert hashes[0] == hashes[1] and hashes[0] != hashes[2]


@pytest.mark.parametrize("spec, says", [
    (LoadSpec(concurrency=0), "concurrency"),
    (LoadSpec(concurrency=None), "neither"),
    (LoadSpec(concurrency=4, rate=2.0), "both"),
    (LoadSpec(concurrency=None, rate=0.0), "rate"),
    (LoadSpec(concurrency=None, rate=-1.0), "rate"),
    (LoadSpec(concurrency=None, rate=float("inf")), "rate"),
    (LoadSpec(concurrency=2.5), "concurrency"),
    (LoadSpec(prompt_tokens=-5), "empty"),
    (LoadSpec(prompt_tokens=10, prompt_spread=10), "empty"),
    (LoadSpec(prompt_spread=-1), "prompt_spread"),
    (LoadSpec(gen_tokens=0), "gen_tokens"),
    (LoadSpec(max_requests=0), "max_requests"),
    (LoadSpec(max_s=0), "max_s"),
    (LoadSpec(max_s=float("nan")), "max_s"),
    (LoadSpec(request_timeout_s=-1), "request_timeout_s"),
    (LoadSpec(warmup_requests=-1), "warmup_requests"),
    (LoadSpec(vocab_size=200), "vocab_size"),
    (LoadSpec(gen_tokens=True), "gen_tokens"),
])
def test_nonsense_specs_are_bad_input(spec, says):
    with pytest.raises(BadInput, match=says) as info:
        spec.validate()
    assert "\n" not in str(info.value)
    with pytest.raises(BadInput):
        run_load("http://127.0.0.1:9", spec)


def test_sound_specs_validate_and_a_bad_url_is_bad_input():
    LoadSpec().validate()
    LoadSpec(concurrency=None, rate=0.5, warmup_requests=0).validate()
    with pytest.raises(BadInput, match="base URL"):
        run_load("ftp://127.0.0.1:8080", LoadSpec())


def test_a_refused_connection_is_a_record_not_an_exception(fake_server):
    fake = fake_server()
    url = fake.url
    fake.stop()  # nothing listens on its port now
    result = run_load(url, LoadSpec(concurrency=2, max_requests=3, warmup_requests=0))
    assert [r.error for r in result.records] == ["connection refused"] * 3


def test_a_load_result_round_trips_through_json():
    result = LoadResult([RequestRecord(0.0, 10, 5, 0.1, 0.5, None, True, 2),
                         RequestRecord(0.2, 12, 0, None, None, CUT, False, 2)], started_at=1.7e9, wall_s=1.25)
    again = LoadResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result
    spec = LoadSpec(concurrency=None, rate=3.0, seed=9)
    assert LoadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_metrics_are_scraped_from_prometheus_text(fake_server):
    fake = fake_server("--ttft", "0.002", "--itl", "0.001")
    run_load(fake.url, LoadSpec(prompt_tokens=8, gen_tokens=3, concurrency=1, max_requests=2))
    metrics = scrape_metrics(fake.url)
    assert metrics["llamacpp:tokens_predicted_total"] == 9  # 3 requests (1 warm-up) of 3 tokens
    assert metrics['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 0
    assert "llamacpp:requests_deferred" in metrics
    assert scrape_metrics(fake_server("--no-metrics").url) == {}  # llama-server without --metrics: 501
    assert parse_prometheus('# HELP x y\nx 1.5\ny{a="b c"} 2e3\nz +Inf\nbad\n') == {
        "x": 1.5, 'y{a="b c"}': 2000.0, "z": float("inf")}


def test_metrics_of_a_server_that_is_not_there_are_empty(fake_server):
    fake = fake_server()
    url = fake.url
    fake.stop()
    assert scrape_metrics(url, timeout_s=2) == {}
