"""Rollout pieces that need no server and no Ray: an operator's pin, conditional node writes, the
served-traffic summary, the canary's figures collected from fake servers with a known speed, and
the pure verdict on figures (pass, fail, inconclusive)."""

from __future__ import annotations

import subprocess
from dataclasses import asdict

import pytest

from orchestrator import canary
from orchestrator.canary import judge
from orchestrator.canarystats import MIN_POINTS
from orchestrator.rollout import parse_pin
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


def canary_payload(objective: str, version: int = 7) -> dict:
    return {**payload(version), "objective": objective, "expected_tps": 1.0,
            "workload": {"n_prompt": 64, "n_gen": 8}}


def judged(servers, objective: str, controls: list[str], tolerance: float):
    return canary.analyse("canary", "chip", canary_payload(objective), controls, None, servers, tolerance)


@pytest.mark.parametrize("objective", ["tg", "pp", "e2e"])
def test_an_equal_canary_passes_the_served_ab_whatever_the_queueing_and_a_slow_one_fails(objective):
    same = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03), "b": (0.002, 0.03)},
                       {"canary": 7, "a": 1, "b": 1})
    verdict = judged(same, objective, ["a", "b"], 0.2)
    assert verdict.outcome == canary.PASS and verdict.reason is None, verdict.analysis
    assert verdict.rate == pytest.approx(verdict.analysis["control_rate"])
    # warm-up round first, then every round has each node once, the order rotated
    taken = 1 + max(first for _, first in same.calls)
    rounds = [[n for n, first in same.calls if first == r] for r in range(taken)]
    assert rounds[0] == ["canary", "a", "b"] and rounds[1] == ["a", "b", "canary"]
    assert all(sorted(r) == ["a", "b", "canary"] for r in rounds)
    # it passed once the canary had MIN_POINTS rates, not before, and took no round more
    assert verdict.analysis["comparison"]["n_canary"] >= MIN_POINTS
    assert verdict.analysis["canary"]["requests"] == taken - 1  # the warm-up's timings are dropped
    assert taken - 1 < canary.PROBE_ROUNDS

    slow_pp, slow_tg = (0.03, 0.03), (0.002, 0.09)  # batch 1: the prompt a token at a time; one thread
    slow = FakeServers({"canary": slow_pp if objective == "pp" else slow_tg, "a": (0.002, 0.03),
                        "b": (0.002, 0.03)}, {"canary": 7, "a": 1, "b": 1})
    verdict = judged(slow, objective, ["a", "b"], 0.4)
    assert verdict.outcome == canary.FAIL and "slower by more than 40%" in verdict.reason
    # a slow canary fails as soon as the test shows it: after the first few rounds, not the budget's
    assert verdict.analysis["comparison"]["n_canary"] < MIN_POINTS, verdict.analysis["comparison"]


def test_a_canary_with_a_failed_request_fails_and_one_that_switched_away_is_inconclusive():
    failing = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03)}, {"canary": 7, "a": 1}, fail={"canary"})
    verdict = judged(failing, "tg", ["a"], 0.2)
    assert verdict.outcome == canary.FAIL and "served requests failed" in verdict.reason
    stale = FakeServers({"canary": (0.002, 0.03), "a": (0.002, 0.03)}, {"canary": 7, "a": 1})
    original = stale.probe

    def switching(node_id, *args, **kwargs):
        out = original(node_id, *args, **kwargs)
        if node_id == "canary" and kwargs.get("first") == 2:
            out["config_version_after"] = 1  # it went back to the old config while measured
        return out

    stale.probe = switching
    verdict = judged(stale, "tg", ["a"], 0.2)
    assert verdict.outcome == canary.INCONCLUSIVE and "while measured" in verdict.reason


def tg_samples(rates: list[float] | None) -> list[list]:
    """Served samples of 32 generated tokens whose generation rates are ``rates``."""
    return [[0.1, 0.1 + 31 / r, 64, 32] for r in rates or []]


def served_figures(rates: list[float] | None, control_rates: list[list[float] | None], *, versions=(7,),
                   errors: int = 0, control_expected: float | None = None) -> dict:
    """Figures as ``collect`` returns them for a serving canary (no node needed): the canary's and
    each control's samples, with these generation rates."""
    def median(values):
        return sorted(values)[len(values) // 2] if values else None

    controls = [{"served": r is not None, "errors": 0, "samples": tg_samples(r), "rate": median(r or []),
                 "expected": control_expected, "error": None if r is not None else "no server running on this node"}
                for r in control_rates]
    medians = [c["rate"] for c in controls if c["rate"]]
    return {"node": "c" * 16, "chip": "chip", "objective": "tg", "version": 7, "method": "served",
            "switched": True, "rate": median(rates or []), "workload": [64, 32],
            "canary": {"served": True, "errors": errors, "requests": len(rates or []), "config_versions": list(versions),
                       "ttft_s": 0.1, "n_gen": 0 if rates is None else 32, "failures": [],
                       "samples": tg_samples(rates)},
            "controls": controls, "control_rate": sorted(medians)[0] if medians else None}


def spread(rate: float, n: int = MIN_POINTS) -> list[float]:
    """``n`` rates around ``rate`` (within +-5 %), as noise spreads them."""
    return [rate * (0.95 + 0.1 * i / max(1, n - 1)) for i in range(n)]


def test_judge_is_a_pure_function_of_the_figures_with_three_outcomes():
    assert judge(served_figures(spread(10.0), [spread(10.0), spread(10.5)]), 12.0, 0.1).outcome == canary.PASS
    slow = judge(served_figures(spread(8.0), [spread(10.0)]), 12.0, 0.1)
    assert slow.outcome == canary.FAIL and "slower by more than 10%" in slow.reason
    assert slow.analysis["ab_floor"] == pytest.approx(slow.analysis["control_rate"] * 0.9)
    assert slow.analysis["comparison"]["ratio"] == pytest.approx(0.8, rel=0.02)  # Hodges-Lehmann
    # a canary expected 1.2x faster than its controls' config (12 over 10 by benchmark) must reach
    # 1.2 x 0.9 of them: at 0.95x (inside the tolerance alone) it fails
    below = judge(served_figures(spread(9.5), [spread(10.0)], control_expected=10.0), 12.0, 0.1)
    assert below.outcome == canary.FAIL and "expected at least 1.08x" in below.reason
    assert judge(served_figures(spread(10.0), [spread(10.0)]), 12.0, 0.1).reason is None  # control's own unknown
    # cannot decide: too few rates yet, no rate from the canary's requests, its control group
    # silent, or another version served while measured
    for figures in (served_figures(spread(10.0, 3), [spread(10.0, 3)]), served_figures(None, [spread(10.0)]),
                    served_figures(spread(10.0), [None, None]),
                    served_figures(spread(10.0), [spread(10.0)], versions=(1, 7))):
        verdict = judge(figures, 12.0, 0.1)
        assert verdict.outcome == canary.INCONCLUSIVE and verdict.reason, verdict
    assert "needed to pass" in judge(served_figures(spread(10.0, 3), [spread(10.0, 3)]), 12.0, 0.1).reason
    # a gross regression fails on the few rates that show it
    assert judge(served_figures(spread(4.0, 3), [spread(10.0, 3), spread(10.0, 3)]), 12.0, 0.1).outcome == canary.FAIL
    # no control node left: the rates are held to the expected figure (one-sample test)
    assert judge(served_figures(spread(12.0), []), 12.0, 0.1).outcome == canary.PASS
    alone = judge(served_figures(spread(6.0), []), 12.0, 0.1)
    assert alone.outcome == canary.FAIL and "expected at least 10.80" in alone.reason
    assert judge(served_figures(None, [spread(10.0)], errors=2), 12.0, 0.1).outcome == canary.FAIL
    assert judge({**served_figures(None, []), "switched": False}, 12.0, 0.1).outcome == canary.FAIL
    bench = {"node": "n" * 16, "chip": "chip", "objective": "tg", "version": 7, "method": "benchmark"}
    assert judge({**bench, "rate": 11.0}, 12.0, 0.1).outcome == canary.PASS
    assert judge({**bench, "rate": 10.0}, 12.0, 0.1).outcome == canary.FAIL
    assert judge({**bench, "rate": None}, 12.0, 0.1).outcome == canary.FAIL  # the benchmark failed


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
    from orchestrator.nodecalls import Applier
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


def test_a_models_rollout_lease_is_kept_by_a_live_holder_and_taken_over_when_stale(tmp_path):
    """The lease on a model's rollouts (migration 0006) on a real SQLite database: a holder on
    another host keeps it while its heartbeat is fresh, loses it once silent past the time to live;
    a holder on this host whose process is gone loses it at once."""
    from datetime import UTC, datetime, timedelta

    from orchestrator import lease
    from orchestrator.db import open_database, repo
    from workers.simulated import sim_model_info

    db = open_database(f"sqlite:///{tmp_path / 'results.db'}")
    with db.session() as s:
        model_id = repo.upsert_model(s, sim_model_info("sim://llama2-7b/q4_0")).id
    elsewhere, me = "elsewhere:4242:abcd1234", lease.new_owner()

    def acquire(owner: str, now: datetime | None = None) -> str | None:
        with db.session() as s:
            return repo.acquire_rollout_lease(s, model_id, owner, lease.stale_before(now), lease.holder_is_gone)

    assert acquire(elsewhere) is None
    assert acquire(me) == elsewhere  # alive, as far as anyone here can tell
    assert acquire(me, datetime.now(UTC) + timedelta(seconds=lease.LEASE_TTL_S + 1)) is None  # silent too long
    with db.session() as s:
        assert repo.rollout_lease_holder(s, model_id)[0] == me
        assert not repo.renew_rollout_lease(s, model_id, elsewhere)  # the old holder is fenced off
    proc = subprocess.Popen(["true"])
    proc.wait()
    gone = f"{me.split(':')[0]}:{proc.pid}:deadbeef"  # a holder on this host whose process exited
    with db.session() as s:
        repo.release_rollout_lease(s, model_id, me)
    assert acquire(gone) is None and acquire(me) is None
