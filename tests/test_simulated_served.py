"""Served traffic on simulated Macs (issue 22.6): batched decoding, llama-server's continuous
batching, capacity at an SLO, the public rows the batch constants are fitted on, and `sim capacity`.

Every figure here is simulated (workers/simulated_batched.py, workers/simulated_served.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from workers import placement, simulated
from workers import simulated_batched as batched
from workers import simulated_served as served
from workers.errors import BadInput
from workers.slo import figures, parse_slo

SLO = parse_slo("ttft_p90=1s,tps_p10=20")
BIG = simulated.parse_chip("M2 Ultra/76/192")
SHAPE = simulated.model_shape("llama3-8b", "q4_0")


def config(slots: int, ctx: int = 512, chip=BIG, shape=SHAPE) -> served.ServerConfig:
    return served.ServerConfig(slots, ctx, served.default_params(chip, shape))


def level(slots: int, users: int, chip=BIG):
    """One level of the issue's workload (280-token prompts, 128 out) on ``slots`` slots."""
    return served.served_figures(chip, SHAPE, config(slots, chip=chip), served.ServedLoad(users, 280, 128), SLO)


# ---------------------------------------------------------------- batched decoding (simulated_batched)


def test_a_batch_of_one_is_the_single_stream_token():
    """Rule 1: the batched model adds to the single-stream one and leaves it as it is."""
    params = served.default_params(BIG, SHAPE)
    steps = batched.step_model(BIG, SHAPE, params)
    for ctx in (300, 2000):
        single = simulated.predict(BIG, SHAPE, params, n_prompt=0, n_gen=2, depth=ctx - 1).tg_tps
        assert 1 / steps.decode_s(1, ctx) == pytest.approx(single, rel=1e-9)


def test_aggregate_decode_rate_rises_then_flattens_with_the_batch():
    """Rules 2-4: bandwidth-bound small batches gain almost a token per sequence, large ones flatten
    at the prompt rate (compute-bound); a 9-token batch pays a whole 32-token tile."""
    steps = batched.step_model(BIG, SHAPE, served.default_params(BIG, SHAPE))

    def rate(b: int) -> float:
        return b / steps.decode_s(b, b * 400)

    assert rate(2) > 1.5 * rate(1) and rate(4) > rate(2) and rate(8) > rate(4)
    assert rate(32) < rate(64) < rate(128)
    assert rate(512) == pytest.approx(rate(256), rel=0.02) and rate(512) < steps.compute_bound_tps
    assert rate(9) < rate(8)  # the kernel switch (rule 4)


def test_served_aggregate_rises_then_flattens_and_per_user_rate_falls_with_slots():
    """Users = slots: the aggregate rises with the slots while the weight read is shared, then
    flattens once prompts and decode tokens fill the GPU; each user's rate falls all along."""
    by_slots = {s: level(s, s) for s in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    aggregate = {s: f.throughput_tps for s, f in by_slots.items()}
    assert aggregate[1] < aggregate[2] < aggregate[4] < aggregate[8]
    assert aggregate[32] < aggregate[64] < aggregate[128]
    assert aggregate[256] == pytest.approx(aggregate[128], rel=0.05)
    per_user = [f.percentiles["tps_p50"] for f in by_slots.values()]
    assert all(a > b for a, b in zip(per_user, per_user[1:], strict=False)), per_user
    # the per-user rate is the aggregate over the active slots
    eight = by_slots[8]
    assert eight.percentiles["tps_p50"] == pytest.approx(eight.throughput_tps / 8, rel=0.15)


def test_ttft_grows_once_users_exceed_slots():
    """Rule 3: with 4 slots, up to 4 users start at once; more wait in the queue."""
    ttft = {u: level(4, u).percentiles["ttft_p90"] for u in (1, 2, 4, 8, 16, 32)}
    assert max(ttft[1], ttft[2], ttft[4]) < 1.5 * min(ttft[1], ttft[2], ttft[4])
    assert ttft[8] > 3 * ttft[4] and ttft[16] > ttft[8] and ttft[32] > ttft[16]


def test_kv_cache_that_does_not_fit_the_working_set_is_refused():
    """Rule 1: weights + KV for slots x ctx over the working set (75 % of 8 GB) is out of memory."""
    small = simulated.parse_chip("M1/8/8")
    fits, too_many = config(4, chip=small), config(64, chip=small)
    assert served.refusal(small, SHAPE, fits) is None
    why = served.refusal(small, SHAPE, too_many)
    assert why.startswith("out of memory")
    with pytest.raises(BadInput, match="out of memory"):
        served.simulate_load(small, SHAPE, too_many, served.ServedLoad(1, 280, 128))
    refused = served.capacity(small, SHAPE, SLO, config=too_many)
    assert refused.users == 0 and refused.limited_by == "memory" and refused.figures is None
    # the KV cache grows by one slot's context per slot (placement's one estimate)
    one, two = (placement.gpu_need(SHAPE, fits.params, n * 512) for n in (1, 2))
    assert two.kv_cache - one.kv_cache == pytest.approx(one.kv_cache) and two.weights == one.weights
    assert served.refusal(BIG, SHAPE, config(4, ctx=256), served.ServedLoad(1, 280, 128)).startswith("context")


def test_requests_are_slo_records_judged_by_slo_figures_and_seeded():
    load = served.ServedLoad(6, 280, 128)
    records = served.simulate_load(BIG, SHAPE, config(4), load, seed=3)
    assert sum(r.warmup for r in records) == 6 and len(records) == 6 * (1 + load.measured_per_user)
    assert all(r.ok and r.users == 6 and r.gen_tokens == 128 for r in records)
    assert served.served_figures(BIG, SHAPE, config(4), load, SLO, seed=3) == figures(records, SLO)
    assert served.simulate_load(BIG, SHAPE, config(4), load, seed=3) == records
    assert served.simulate_load(BIG, SHAPE, config(4), load, seed=4) != records


# ---------------------------------------------------------------- capacity


def test_capacity_is_the_most_users_meeting_the_slo():
    found = served.capacity(BIG, SHAPE, SLO, config=config(8))
    assert found.users >= 1 and found.figures.meets_slo and found.simulated
    assert found.levels[found.users] and not found.levels[found.users + 1]
    assert found.tps_p10 >= 20 and found.ttft_p90 <= 1.0


def test_capacity_is_monotone_in_a_looser_slo():
    chip = simulated.parse_chip("M2 Max/38/64")
    strict, usual, loose = (parse_slo(t) for t in ("ttft_p90=500ms,tps_p10=30", "ttft_p90=1s,tps_p10=20",
                                                   "ttft_p90=3s,tps_p10=10"))
    fixed = [served.capacity(chip, SHAPE, slo, config=config(16, chip=chip)).users for slo in (strict, usual, loose)]
    assert fixed[0] <= fixed[1] <= fixed[2] and fixed[0] < fixed[2], fixed
    searched = [served.capacity(chip, SHAPE, slo).users for slo in (strict, usual, loose)]
    assert searched[0] <= searched[1] <= searched[2] and searched[0] < searched[2], searched


def test_capacity_search_stops_at_memory_and_keeps_the_fewer_slots_on_a_tie():
    chip = simulated.parse_chip("M1 Max/32/32")
    found = served.capacity(chip, SHAPE, SLO)
    tried = [served.capacity(chip, SHAPE, SLO, config=config(s, chip=chip)).users for s in (1, 2, 4, 8, 16)]
    assert found.users == max(tried) and found.config.slots == 2 ** tried.index(max(tried))


# ---------------------------------------------------------------- the public rows


def test_the_public_batched_rows(capsys):
    """Fit rows reproduce their measured ratio to the single-stream row within 3 %; checks (not
    fitted) within 5 %; base rows are the single-stream model's own prediction, within the 15 % of
    its calibration; superseded rows (kernels llama.cpp replaced) are printed, and slower than the
    model (which describes today's kernels)."""
    lines = []
    for row in batched.batched_rows():
        got, base = batched.predict_row(row), batched.base_row(row)
        ratio = got / batched.predict_row(base)
        measured_ratio = row["s_tg"] / base["s_tg"]
        lines.append(f"{row['era']} {row['chip'].label:16} {row['model']:11} {row['quant']:5} fa {row['fa']:3} "
                     f"pp{row['pp']:<5} tg{row['tg']:<4} B={row['slots']:<3} predicted {got:7.2f} measured "
                     f"{row['s_tg']:7.2f} {got / row['s_tg'] - 1:+6.1%}  ratio {ratio:6.3f} vs "
                     f"{measured_ratio:6.3f} {ratio / measured_ratio - 1:+6.1%}  {row['role']}")
        if row["role"] == "fit":
            assert ratio == pytest.approx(measured_ratio, rel=0.03)
        elif row["role"] == "check":
            assert ratio == pytest.approx(measured_ratio, rel=0.05)
        elif row["role"] == "base":
            assert got == pytest.approx(row["s_tg"], rel=0.15)
        else:
            assert row["role"] == "superseded" and got > row["s_tg"]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    k = batched.fitted_batch()
    assert k.small_batch_s_per_param_core_ghz > 0 and k.tile_s_per_param_core_ghz > 0
    assert {r["role"] for r in batched.batched_rows()} == {"base", "fit", "check", "superseded"}


def test_every_row_names_its_source():
    assert all(r["source"].startswith("https://github.com/ggml-org/") for r in batched.batched_rows())


# ---------------------------------------------------------------- the CLI


def test_sim_capacity_prints_the_libraries_answer_labelled_simulated():
    runner = CliRunner()
    args = ["sim", "capacity", "--chip", "M2 Ultra/76/192", "--model-shape", "llama3-8b", "--slots", "8", "--json"]
    rows = json.loads(runner.invoke(main, args).output)
    truth = served.capacity(BIG, SHAPE, SLO, config=config(8))
    assert len(rows) == 1 and rows[0] == json.loads(json.dumps(truth.row()))
    assert rows[0]["simulated"] is True and rows[0]["users"] == truth.users and rows[0]["slots"] == 8
    table = runner.invoke(main, ["sim", "capacity", "--chip", "M2 Ultra/76/192", "--model-shape", "llama3-8b",
                                 "--slots", "8", "--slo", "ttft_p90=2s,tps_p10=10"])
    assert table.exit_code == 0 and "(simulated)" in table.output and "ttft_p90=2s,tps_p10=10" in table.output


@pytest.mark.parametrize("extra, match", [
    (["--slo", "ttft_p90=1x"], "--slo 'ttft_p90=1x'"),
    (["--slo", "speed_p90=1s"], "unknown metric 'speed'"),
    (["--slo", ""], "--slo: empty"),
    (["--all-chips"], "one of them"),
    (["--ctx-per-slot", "1024"], "--ctx-per-slot needs --slots"),
    (["--slots", "4", "--ctx-per-slot", "256"], "context per slot 256 < 280 prompt + 128 generated"),
])
def test_sim_capacity_bad_input_is_one_line(extra, match):
    result = CliRunner().invoke(main, ["sim", "capacity", "--chip", "M2 Ultra/76", "--model-shape", "llama3-8b",
                                       *extra])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err and result.stdout == "", err


def test_a_served_study_on_a_simulated_mac_finds_more_users_than_llama_servers_defaults(sqlite_url, ray_cluster):
    """The served kind through the one study loop on simulated M2 Ultras (issue 22): a capacity
    study searches llama-server's knobs; its recommendation is never below the defaults' capacity."""
    from orchestrator import learn
    from orchestrator.db import open_database, repo
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune
    from tests.conftest import SIM_CHIPS
    from workers import simulated
    from workers.trial import BenchParams, ServedWorkload, Workload

    db = open_database(sqlite_url)
    model = simulated.sim_model_info("sim://llama3-8b/q4_0")
    cfg = StudyConfig(model=model, n_trials=10, seed=4, objective="capacity", confirm_top=1, confirm_rounds=3,
                      workload=Workload(n_prompt=280, n_gen=128, reps=1),
                      served=ServedWorkload(max_users=64, requests=16, slo="ttft_p90=1s,tps_p10=20"))
    outcome = tune(db, cfg, chip_key=SIM_CHIPS["M2 Ultra/76"], warm=False)
    rec = outcome.recommendation
    assert rec is not None and rec.simulated
    with db.session() as s:
        study = repo.get_study(s, outcome.name)
        trials = repo.study_trials(s, study.id)
        searched = [BenchParams.from_dict(t.params) for t in trials if t.phase == "search"]
        baseline = next(t for t in trials if t.phase == "baseline")
        defaults_capacity = baseline.objective_value
    assert len({p.n_parallel for p in searched}) > 2  # the slots were searched
    assert defaults_capacity == 4  # llama-server's 4 auto slots: the 5th user queues past the SLO
    assert rec.expected_tps >= defaults_capacity
    assert learn.LLAMA_CPP in rec.baselines
    assert all(paired["verdict"] != "slower" for paired in rec.claims.get("vs", {}).values())
