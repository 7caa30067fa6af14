"""The SLO type and the figures of served requests (workers/slo.py): pure, fast tier."""

from __future__ import annotations

import numpy as np
import pytest

from workers.errors import BadInput
from workers.slo import Limit, RequestRecord, figures, parse_slo, percentile


def test_a_slo_is_parsed_with_units_and_prints_back_the_same():
    slo = parse_slo("ttft_p90=1s,itl_p90=50ms,tps_p10=20,e2e_p99=2500ms")
    assert slo.limits == (Limit("ttft", 90, 1.0), Limit("itl", 90, 0.05), Limit("tps", 10, 20.0),
                          Limit("e2e", 99, 2.5))
    assert parse_slo(str(slo)) == slo
    assert parse_slo("ttft_p90=200us").limits[0].value == pytest.approx(200e-6)
    assert parse_slo("ttft_p90=1s,err=0.01").max_error_rate == 0.01


@pytest.mark.parametrize("text", ["", " ", "ttft=1s", "foo_p90=1s", "ttft_p90=1s,ttft_p50=2s", "ttft_p90=0",
                                  "ttft_p90=-1", "ttft_p100=1s", "ttft_p0=1s", "tps_p10=20ms", "ttft_p90=1h",
                                  "ttft_p90=nan", "ttft_p90=inf", "err=1.5", "err=0.1", "ttft_p90=1s,,"])
def test_a_bad_slo_is_one_line(text):
    with pytest.raises(BadInput) as caught:
        parse_slo(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("p", [1, 10, 50, 90, 99])
def test_percentiles_interpolate_as_numpy_does(p):
    values = list(np.random.default_rng(3).lognormal(size=37))
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert percentile([], p) is None


def _request(start, ttft, e2e, gen=11, error=None, warmup=False):
    return RequestRecord(start_s=start, prompt_tokens=100, gen_tokens=gen, ttft_s=ttft, e2e_s=e2e, error=error,
                         warmup=warmup)


def test_itl_and_per_user_rate_are_aiperfs_per_request_figures():
    record = _request(0.0, 0.5, 1.5, gen=11)  # 10 gaps in 1 s
    assert record.itl_s == pytest.approx(0.1)
    assert record.tps == pytest.approx(10.0)
    assert _request(0.0, 0.5, 0.5, gen=1).itl_s is None  # one token: no gap to time


def test_warm_up_is_never_judged_and_a_failed_request_breaks_the_slo():
    slo = parse_slo("ttft_p90=1s")
    good = [_request(i, 0.2, 1.0) for i in range(10)]
    warm = [_request(-1, 5.0, 9.0, warmup=True), _request(-1, None, None, error="refused", warmup=True)]
    assert figures(good + warm, slo).meets_slo
    failed = good + [_request(10, None, None, error="cut", gen=0)]
    shown = figures(failed, slo)
    assert not shown.meets_slo and "1 of 11 requests failed" in shown.why
    assert parse_slo("ttft_p90=1s,err=0.1").breach(failed) == ""


def test_goodput_counts_the_requests_that_meet_every_limit_over_the_window():
    slo = parse_slo("ttft_p90=1s,tps_p10=5")
    records = [_request(0.0, 0.5, 1.5), _request(0.0, 1.5, 2.5),  # the second starts too late
               _request(0.5, 0.5, 3.5),  # 10 gaps in 3 s: 3.3 tok/s, too slow
               _request(2.0, 0.2, 2.0)]  # ends at 4.0: the window is 0..4 s
    shown = figures(records, slo)
    assert shown.window_s == pytest.approx(4.0)
    assert shown.goodput == pytest.approx(2 / 4.0)
    assert shown.throughput_tps == pytest.approx(44 / 4.0)
    assert shown.percentiles["ttft_p50"] == pytest.approx(0.5)
    assert not shown.meets_slo  # ttft p90 is 1.2 s


def test_a_rate_limit_holds_from_below_and_a_latency_from_above():
    assert Limit("tps", 10, 20).holds(25) and not Limit("tps", 10, 20).holds(15)
    assert Limit("ttft", 90, 1).holds(0.9) and not Limit("ttft", 90, 1).holds(1.1)
    assert not Limit("ttft", 90, 1).holds(None)
