"""Rollout pieces that need no server and no Ray: an operator's pin, conditional node writes, the
served-traffic summary, the served canary analysis over fake servers with a known speed."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from orchestrator.rollout import PROBE_ROUNDS, _Row, judge_canary, parse_pin
from workers import nodeconfig
from workers.errors import BadInput
from workers.probe import RequestResult, prompt_of, summarise

NODE = "c0" * 16


def payload(version: int) -> dict:
    return {"version": version, "rollout_id": version, "model_sha256": "a" * 64, "model_name": "m",
            "objective": "tg", "expected_tps": 10.0, "params": {"n_gpu_layers": 1, "n_threads": 2, "n_batch": 64,
                                                               "n_ubatch": 64, "flash_attn": False}}


def test_a_pin_is_llama_cpp_flags_checked_one_by_one():
    assert parse_pin("-ngl 99 -t 4 -b 512") == {"n_gpu_layers": 99, "n_threads": 4, "n_batch": 512}
    assert parse_pin("--threads 2 -fa on -ub 128") == {"n_threads": 2, "flash_attn": True, "n_ubatch": 128}
    for bad in ("", "-t", "-x 1", "-t four", "-t 0", "-b 99999999", "-fa maybe", "-t 4; rm -rf /"):
        with pytest.raises(BadInput):
            parse_pin(bad)


def test_a_conditional_write_never_replaces_a_config_it_was_not_told_about():
    nodeconfig.write(NODE, None)
    assert nodeconfig.write(NODE, payload(1), only_if=[None]) == {"previous": None, "applied": True}
    # an apply of config 2 over "no config" is refused: the node holds 1 now
    assert nodeconfig.write(NODE, payload(2), only_if=[None]) == {"previous": payload(1), "applied": False}
    # a restore to "no config" only over this rollout's config: the node keeps 1
    assert nodeconfig.write(NODE, None, only_if=[payload(2), None])["applied"] is False
    assert nodeconfig.read(NODE) == payload(1)
    assert nodeconfig.write(NODE, None, only_if=[payload(1)])["applied"] is True
    assert nodeconfig.read(NODE) is None


def test_served_figures_come_from_the_successful_requests_and_count_the_rest():
    results = [RequestResult(True, ttft_s=0.5, total_s=1.5, n_gen=11), RequestResult(True, ttft_s=0.25, total_s=1.25,
                                                                                    n_gen=11),
               RequestResult(False, error="HTTP 500")]
    out = summarise(results, n_prompt=64)
    assert out["errors"] == 1 and out["error_rate"] == pytest.approx(1 / 3)
    assert out["tg_tps"] == pytest.approx(10.0) and out["pp_tps"] == pytest.approx((128 + 256) / 2)
    assert summarise([], 64)["error_rate"] == 1.0


def test_the_two_prompts_of_a_sample_are_as_long_and_share_no_prefix_a_server_would_reuse():
    prompts = [prompt_of(64, seed) for seed in range(12)]
    assert len({len(p) for p in prompts}) == 1 and len(set(prompts)) == 12
    assert len({p[:2] for p in prompts[:10]}) == 10  # they differ by their second character


def test_service_figures_are_the_fastest_samples_so_queueing_does_not_count():
    # the same server: one sample waited 2 s behind another client's request, one 1 s
    results = [RequestResult(True, ttft_s=0.2, total_s=0.9, n_gen=8, n_prompt=64),
               RequestResult(True, ttft_s=2.2, total_s=0.9, n_gen=8, n_prompt=64),
               RequestResult(True, ttft_s=0.2, total_s=1.9, n_gen=8, n_prompt=64)]
    out = summarise(results, 64)
    assert out["best_pp_tps"] == pytest.approx(320) and out["best_tg_tps"] == pytest.approx(10)
    assert out["tg_tps"] != pytest.approx(10)  # the medians are what a client got, queueing included
    too_few = summarise([RequestResult(True, ttft_s=0.5, total_s=0.4, n_gen=2, n_prompt=64)], 64)
    assert too_few["best_tg_tps"] is None


class FakeServers:
    """Nodes whose servers take a fixed service time per token, plus a queueing delay that comes
    and goes (another client's request ahead), and say which config version they serve."""

    def __init__(self, per_token_s: dict[str, tuple[float, float]], versions: dict[str, int],
                 fail: set[str] = frozenset()) -> None:
        self.per_token_s, self.versions, self.fail = per_token_s, versions, fail
        self.calls: list[tuple[str, int]] = []

    def serve_status(self, node_id):
        return {"fresh": True, "ready": True, "config_version": self.versions[node_id]}

    def read(self, node_id):
        return None

    def probe(self, node_id, n_prompt, n_gen, n_requests=1, first=0):
        self.calls.append((node_id, first))
        pp_s, tg_s = self.per_token_s[node_id]
        wait = 3.0 if (len(self.calls) % 3 == 0) else 0.0  # every third request queued behind a long one
        ok = node_id not in self.fail
        result = RequestResult(ok, ttft_s=n_prompt * pp_s + tg_s + wait, total_s=n_prompt * pp_s + n_gen * tg_s,
                               n_gen=n_gen, n_prompt=n_prompt, error=None if ok else "HTTP 500")
        return {"served": True, "results": [asdict(result)], "config_version": self.versions[node_id],
                "config_version_after": self.versions[node_id]}


def canary_row(objective: str, version: int = 7, node: str = "canary") -> _Row:
    config = {**payload(version), "objective": objective, "expected_tps": 1.0,
              "workload": {"n_prompt": 64, "n_gen": 8}}
    return _Row(1, node, "chip", 0, config, None, "applied", True, None)


def control_row(node: str) -> _Row:
    return _Row(2, node, "chip", 1, payload(1), None, "pending", False, None)


@pytest.mark.parametrize("objective", ["tg", "pp", "e2e"])
def test_an_equal_canary_passes_the_served_ab_whatever_the_queueing_and_a_slow_one_fails(objective):
    same = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03), "b": (0.002, 0.03)},
                       {"canary": 7, "a": 1, "b": 1})
    verdict = judge_canary(canary_row(objective), [control_row("a"), control_row("b")], None, same, 0.2)
    assert verdict.failure is None, verdict.analysis
    assert verdict.rate == pytest.approx(verdict.analysis["control_rate"])
    # warm-up round first, then every round has each node once, the order rotated
    rounds = [[n for n, first in same.calls if first == r] for r in range(1 + PROBE_ROUNDS)]
    assert rounds[0] == ["canary", "a", "b"] and rounds[1] == ["a", "b", "canary"]
    assert all(sorted(r) == ["a", "b", "canary"] for r in rounds)
    assert verdict.analysis["canary"]["requests"] == PROBE_ROUNDS  # the warm-up's timings are dropped

    slow_pp, slow_tg = (0.03, 0.03), (0.002, 0.09)  # batch 1: the prompt a token at a time; one thread
    slow = FakeServers({"canary": slow_pp if objective == "pp" else slow_tg, "a": (0.002, 0.03),
                        "b": (0.002, 0.03)}, {"canary": 7, "a": 1, "b": 1})
    verdict = judge_canary(canary_row(objective), [control_row("a"), control_row("b")], None, slow, 0.4)
    assert verdict.failure and "slower by more than 40%" in verdict.failure


def test_a_canary_with_a_failed_request_or_the_wrong_version_fails():
    failing = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03)}, {"canary": 7, "a": 1}, fail={"canary"})
    verdict = judge_canary(canary_row("tg"), [control_row("a")], None, failing, 0.2)
    assert verdict.failure and "served requests failed" in verdict.failure
    stale = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03)}, {"canary": 7, "a": 1})
    stale.versions["canary"] = 7
    original = stale.probe

    def switching(node_id, *args, **kwargs):
        out = original(node_id, *args, **kwargs)
        if node_id == "canary" and kwargs.get("first") == 2:
            out["config_version_after"] = 1  # it went back to the old config while measured
        return out

    stale.probe = switching
    verdict = judge_canary(canary_row("tg"), [control_row("a")], None, stale, 0.2)
    assert verdict.failure and "while measured" in verdict.failure


def test_a_pp_sample_is_two_prompt_timings_and_the_fastest_counts():
    results = [RequestResult(True, ttft_s=0.5, total_s=0.2, n_gen=1, n_prompt=64),  # the first one waited
               RequestResult(True, ttft_s=0.3, total_s=0.4, n_gen=1, n_prompt=64)]
    out = summarise(results, 64)
    assert out["best_pp_tps"] == pytest.approx(320) and out["best_tg_tps"] is None


class OneResult:
    """A dispatcher whose every trial returns the same pp and tg samples at once."""

    def __init__(self, samples: list) -> None:
        self.samples, self.specs = samples, []

    def submit(self, spec, chip_key, node_id=None):
        self.specs.append(spec)
        return len(self.specs)

    def wait(self, refs, timeout_s):
        return list(refs)

    def result(self, ref, trial_key):
        from workers.trial import TrialResult

        return TrialResult(trial_key=trial_key, ok=True, samples=list(self.samples))

    def cancel(self, ref):
        pass


@pytest.mark.parametrize("objective,expected", [
    ("tg", 32.0),  # 128 tokens in 4 s
    ("pp", 1024.0),  # 512 tokens in 0.5 s
    ("e2e", 640 / 4.5),  # the whole request: 512 + 128 tokens in 0.5 + 4 s, as an effective rate
])
def test_verification_measures_the_recommendations_own_objective_and_workload(objective, expected):
    """An e2e recommendation's expected value is an effective end-to-end rate: verifying it by
    its tg rate (as rollouts once did) compares two different figures."""
    from orchestrator.rollout import Applier
    from workers import simulated
    from workers.trial import Sample

    fake = OneResult([Sample("pp", 0, 512, 0.5), Sample("tg", 0, 128, 4.0)])
    applier = Applier()
    applier.dispatcher = fake
    rec = {**payload(1), "objective": objective, "workload": {"n_prompt": 512, "n_gen": 128}}
    measured = applier.verify(NODE, "M2 Ultra/76", simulated.sim_model_info("sim://llama2-7b/q4_0"), rec)
    assert measured == pytest.approx(expected)
    spec = fake.specs[0]
    assert (spec.workload.n_prompt, spec.workload.n_gen) == (512, 128)
