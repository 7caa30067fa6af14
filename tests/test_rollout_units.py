"""Rollout pieces that need no server and no Ray: an operator's pin, conditional node writes, the
served-traffic summary."""

from __future__ import annotations

import pytest

from orchestrator.rollout import parse_pin
from workers import nodeconfig
from workers.errors import BadInput
from workers.probe import RequestResult, summarise

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
