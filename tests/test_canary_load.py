"""The canary analysis of llama-server nodes (orchestrator.canaryload through orchestrator.canary):
streamed load on the canary and its controls at the same moment, per-request metrics judged at
once. Fast tier: fake streaming servers with a known TTFT and ITL (bench/fake_openai_server.py) in
this process, the node calls made here instead of through Ray; every wait is a thread's end."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from bench.fake_openai_server import FakeConfig, FakeServer
from orchestrator import canary, canaryload, canarystats
from workers import timedload
from workers.loadgen import LoadSpec

TTFT_S, ITL_S = 0.02, 0.008


@pytest.fixture
def servers() -> Iterator[dict]:
    """Start fake servers on demand (``start(name, ttft, itl, fail_every)``); all stopped at the end."""
    started: dict[str, FakeServer] = {}
    threads = []

    def start(name: str, ttft_s: float = TTFT_S, itl_s: float = ITL_S, fail_every: int = 0) -> FakeServer:
        server = FakeServer(config=FakeConfig(ttft_s=ttft_s, itl_s=itl_s, fail_every=fail_every))
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        started[name] = server
        threads.append(thread)
        return server

    yield start
    for server in started.values():
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(10)


class StreamingNodes:
    """Nodes serving with llama-server (the status's kind), their load run here against fake servers."""

    def __init__(self, servers: dict[str, FakeServer], versions: dict[str, int], kind: str = "llama-server") -> None:
        self.servers, self.versions, self.kind = servers, versions, kind
        self.loads: list[tuple[str, LoadSpec, float]] = []

    def serve_status(self, node_id):
        return {"fresh": True, "ready": True, "config_version": self.versions[node_id], "kind": self.kind}

    def read(self, node_id):
        return None

    def load(self, node_id, spec, duration_s):
        self.loads.append((node_id, spec, duration_s))
        result = timedload.run_for(self.servers[node_id].url, spec, duration_s)
        v = self.versions[node_id]
        return {"served": True, "records": [r.to_dict() for r in result.records], "config_version": v,
                "config_version_after": v}

    def probe(self, *args, **kwargs):
        raise AssertionError("a llama-server canary is judged by streamed load, not by the rate-only probe")


def payload() -> dict:
    return {"version": 7, "rollout_id": 7, "model_sha256": "a" * 64, "model_name": "m", "objective": "tg",
            "expected_tps": 1.0, "params": {"n_gpu_layers": 0, "n_threads": 2, "n_batch": 64, "n_ubatch": 64,
                                            "flash_attn": False}, "workload": {"n_prompt": 64, "n_gen": 8}}


@pytest.fixture
def quick_rounds(monkeypatch):
    """Rounds of 1 s with 4 users per node: the fake servers answer in ~0.27 s, so a round gives each
    node about 14 requests and the 50 a pass needs come in about four rounds."""
    monkeypatch.setattr(canaryload, "ROUND_S", 1.0)
    monkeypatch.setattr(canaryload, "CONCURRENCY", 4)


def analysed(nodes: StreamingNodes, controls: list[str], tolerance: float = 0.3) -> canary.Verdict:
    return canary.analyse("canary", "chip", payload(), controls, None, nodes, tolerance)


def test_a_timed_load_lets_every_request_finish_and_sends_none_after_its_time(servers):
    server = servers("a", itl_s=0.02)
    spec = LoadSpec(prompt_tokens=16, gen_tokens=20, concurrency=3, warmup_requests=2, max_requests=1000, seed=5)
    result = timedload.run_for(server.url, spec, 1.0)
    records = result.records
    assert records and all(r.ok for r in records)  # none cut: each ran to its end (~0.4 s), after the 1 s too
    assert max(r.start_s for r in records) < 1.0 < max(r.end_s for r in records)
    assert [r.warmup for r in records[:3]] == [True, True, False]
    assert all(r.gen_tokens == 20 and r.users == 3 for r in records)
    log = server.state.log
    assert len({e["prompt_hash"] for e in log}) == len(log) == len(records)  # no two prompts alike
    assert server.state.max_inflight == 3


def test_an_equal_canary_passes_on_every_metric_with_the_requests_kayenta_asks_for(servers, quick_rounds):
    fakes = {n: servers(n) for n in ("canary", "a", "b")}
    nodes = StreamingNodes(fakes, {"canary": 7, "a": 1, "b": 1})
    verdict = analysed(nodes, ["a", "b"])
    judgement = verdict.analysis["judgement"]
    assert verdict.outcome == canary.PASS, judgement
    assert verdict.analysis["method"] == "served-load" and set(judgement["metrics"]) == {"ttft", "itl", "rate", "errors"}
    for name, comparison in judgement["metrics"].items():
        assert comparison["outcome"] == canarystats.PASS, name
        assert comparison["n_canary"] >= canarystats.MIN_POINTS_PER_ARM and comparison["n_control"] >= 50
    assert judgement["metrics"]["itl"]["ratio"] == pytest.approx(1.0, abs=0.1)
    # every request kept in the record, the control group's pooled from both nodes
    assert len(verdict.analysis["canary"]["records"]) == judgement["metrics"]["errors"]["n_canary"]
    assert verdict.analysis["canary"]["itl_s"] == pytest.approx(ITL_S, rel=0.25)
    # each round loaded every node for the same time at the same moment: their arrivals span one stretch
    arrivals = {n: [e["arrived"] for e in f.state.log] for n, f in fakes.items()}
    assert max(abs(min(arrivals["canary"]) - min(a)) for a in arrivals.values()) < 0.5
    assert max(abs(max(arrivals["canary"]) - max(a)) for a in arrivals.values()) < 1.0
    rounds = sorted({spec.seed for _, spec, _ in nodes.loads})
    assert len(nodes.loads) == 3 * len({(spec.seed - 1) // 64 for _, spec, _ in nodes.loads})
    assert len(rounds) == len(nodes.loads)  # every node's load of every round seeded apart


def test_a_canary_with_a_slower_itl_fails_on_itl_alone(servers, quick_rounds):
    fakes = {"canary": servers("canary", itl_s=ITL_S * 1.6), "a": servers("a"), "b": servers("b")}
    verdict = analysed(StreamingNodes(fakes, {"canary": 7, "a": 1, "b": 1}), ["a", "b"], tolerance=0.9)
    metrics = verdict.analysis["judgement"]["metrics"]
    assert verdict.outcome == canary.FAIL and "in itl" in verdict.reason, verdict.reason
    assert metrics["itl"]["outcome"] == canarystats.FAIL and metrics["itl"]["ratio"] == pytest.approx(1.6, rel=0.15)
    assert metrics["ttft"]["outcome"] != canarystats.FAIL  # the first token came as fast as the controls'
    assert metrics["rate"]["outcome"] != canarystats.FAIL  # the rate's tolerance (90 %) covers 1/1.6


def test_a_canary_whose_requests_fail_fails_on_errors(servers, quick_rounds):
    fakes = {"canary": servers("canary", fail_every=10), "a": servers("a"), "b": servers("b")}
    verdict = analysed(StreamingNodes(fakes, {"canary": 7, "a": 1, "b": 1}), ["a", "b"])
    errors = verdict.analysis["judgement"]["metrics"]["errors"]
    assert verdict.outcome == canary.FAIL and "errors" in verdict.reason
    assert errors["canary_events"] >= 1 and errors["control_events"] == 0


def test_without_controls_the_rate_is_held_to_the_expected_figure(servers, quick_rounds):
    fakes = {"canary": servers("canary")}
    per_request = 1 / ITL_S  # tg: the request's own tok/s
    ok = canary.analyse("canary", "chip", {**payload(), "expected_tps": per_request}, [], None,
                        StreamingNodes(fakes, {"canary": 7}), 0.3)
    assert ok.outcome == canary.PASS and set(ok.analysis["judgement"]["metrics"]) == {"rate", "errors"}
    slow = canary.analyse("canary", "chip", {**payload(), "expected_tps": 3 * per_request}, [], None,
                          StreamingNodes(fakes, {"canary": 7}), 0.3)
    assert slow.outcome == canary.FAIL and "expected" in slow.reason


def load_figures(canary_itl: list[float], control_itl: list[float], *, versions=(7,), controls_served=True) -> dict:
    """Figures as collect returns them for a llama-server canary: requests of 32 tokens, TTFT 0.1 s."""
    def rows(itls):
        return [[i * 0.5, 0.1, 0.1 + 31 * itl, 32, None] for i, itl in enumerate(itls)]

    control = ({"served": True, "records": rows(control_itl), "node": "a", "expected": None} if controls_served
               else {"served": False, "error": "no server running on this node", "node": "a"})
    return {"node": "c" * 16, "chip": "chip", "objective": "tg", "version": 7, "method": "served-load",
            "switched": True, "workload": [64, 32], "rate": 1 / canary_itl[0] if canary_itl else None,
            "control_rate": None, "canary": {"served": True, "records": rows(canary_itl),
                                             "config_versions": list(versions), "ttft_s": 0.1, "itl_s": 0.02},
            "controls": [control]}


def test_judging_streamed_figures_is_pure_with_three_outcomes():
    n = canarystats.MIN_POINTS_PER_ARM
    even = [0.02 * (0.95 + 0.1 * i / (n - 1)) for i in range(n)]
    assert canary.judge(load_figures(even, even + even), 1.0, 0.3).outcome == canary.PASS
    regressed = canary.judge(load_figures([v * 1.3 for v in even], even + even), 1.0, 0.3)
    assert regressed.outcome == canary.FAIL and regressed.analysis["judgement"]["metrics"]["itl"]["outcome"] == "fail"
    short = canary.judge(load_figures(even[:20], even), 1.0, 0.3)
    assert short.outcome == canary.INCONCLUSIVE and "needed to pass" in short.reason
    assert canary.judge(load_figures(even, even, versions=(1, 7)), 1.0, 0.3).outcome == canary.INCONCLUSIVE
    silent = canary.judge(load_figures(even, even, controls_served=False), 1.0, 0.3)
    assert silent.outcome == canary.INCONCLUSIVE and "gave no figures" in silent.reason


def test_a_node_of_llama_cpp_pythons_kind_keeps_the_rate_only_probe():
    from tests.test_rollout_units import FakeServers, canary_payload

    same = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03)}, {"canary": 7, "a": 1})
    verdict = canary.analyse("canary", "chip", canary_payload("tg"), ["a"], None, same, 0.2)
    assert verdict.analysis["method"] == "served" and "judgement" not in verdict.analysis and same.calls
