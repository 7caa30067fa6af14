"""bench/cuda/side_by_side.py: a tool run for a fixed time, and llama-optimus's printed trials read back."""

from __future__ import annotations

import sys

from bench.cuda.side_by_side import optimus_trials, run_for


def test_run_for_stamps_lines_and_ends_the_whole_session(tmp_path):
    log = tmp_path / "log"
    code = "import subprocess, sys, time; print('hello', flush=True); " \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    run_for([sys.executable, "-c", code], 2.0, log)
    lines = log.read_text().splitlines()
    assert lines[0].split("\t")[1].startswith("START") and lines[1].endswith("\thello")
    assert "END rc=" in lines[-1]
    stamps = [float(line.split("\t")[0]) for line in lines]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] < 30  # SIGTERM ended it, not the sleep


def test_optimus_trials_are_read_with_their_flags(tmp_path):
    log = tmp_path / "optimus.log"
    cmd = ["/b/llama-bench", "--batch-size", "64", "--ubatch-size", "8", "--threads", "3", "-ngl", "20",
           "--model", "/m.gguf", "-r", "3", "-o", "csv", "--no-warmup", "-n", "192", "-p", "0"]
    log.write_text("\n".join([
        "100.0\tSTART []",
        "101.0\tEstimated max ngl = 33",
        f"105.0\tcmd_1: {cmd!r}",
        "107.5\tToken generation speed: 41.250 tokens/s ; std 0.100",
        f"108.0\tcmd_2: {cmd + ['--flash-attn', '1']!r}",
        "109.0\tError: boom",
    ]) + "\n")
    start, trials = optimus_trials(log)
    assert start == 100.0 and [t["tg"] for t in trials] == [41.25, 0.0]
    assert trials[0]["t"] == 107.5
    assert trials[0]["flags"] == ["--batch-size", "64", "--ubatch-size", "8", "--threads", "3", "-ngl", "20"]
    assert trials[1]["flags"][-2:] == ["--flash-attn", "1"]


def test_fleettune_trials_come_from_the_study_database(tmp_path):
    """The first H200 study's database: 25 measured trials, full offload at 290 tok/s the best."""
    from pathlib import Path

    from bench.cuda.side_by_side import fleettune_trials

    log = tmp_path / "log"
    log.write_text("1795962900.0\tSTART []\n")
    db = Path(__file__).resolve().parent.parent / "docs" / "cuda-h200" / "h200-study.db"
    start, trials = fleettune_trials(log, f"sqlite:///{db}")
    assert start == 1795962900.0 and len(trials) == 25
    assert [t["t"] for t in trials] == sorted(t["t"] for t in trials) and trials[0]["t"] > start
    best = max(trials, key=lambda t: t["tg"])
    assert best["tg"] > 280 and best["flags"][:2] == ["-ngl", "33"]
