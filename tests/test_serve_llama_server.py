"""`fleettune serve --server llama-server`: llama.cpp's own server behind the same supervisor and
config interface as llama-cpp-python's, when a `llama-server` binary is found (the file
$FLEETTUNE_LLAMA_SERVER names, `fleettune tools build`'s cache, PATH); skipped, saying so, otherwise,
except in CI (CI=true), where a missing binary fails: CI builds it before the tests (.ci/run). A config change restarts it on the
same port (not zero-drop: docs/serving.md), so this test asserts the serve path, the switch, the
restart after a kill and the served probe, not the absence of drops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_llama_tool, wait_until
from workers import llamatools, nodeconfig, probe, serve, timedload
from workers.loadgen import LoadSpec
from workers.models import read_model_info

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
NODE = "1c" * 16
BINARY = llamatools.find_tool("llama-server")


@pytest.fixture(scope="session", autouse=True)
def llama_server_binary() -> str:
    """Decided before the model is fetched: a skip without the binary, a failure in CI."""
    return require_llama_tool("llama-server")


def payload(sha256: str, version: int, n_threads: int) -> dict:
    return {"version": version, "rollout_id": version, "model_sha256": sha256, "model_name": "smollm2",
            "objective": "tg", "expected_tps": 10.0, "workload": {"n_prompt": 64, "n_gen": 8},
            "params": {"n_gpu_layers": 0, "n_threads": n_threads, "n_batch": 64, "n_ubatch": 64,
                       "flash_attn": False, "n_threads_batch": None}}


def complete(status: dict) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=status["address"], api_key="none", max_retries=0, timeout=60)
    done = client.completions.create(model=status["model"], prompt="1, 2, 3, 4,", max_tokens=4, temperature=0)
    return done.choices[0].text


def test_llama_server_serves_switches_config_and_comes_back_after_a_kill(model_path, tmp_path):
    sha256 = read_model_info(model_path).sha256
    nodeconfig.write(NODE, None)
    env = {**os.environ, "FLEETTUNE_LLAMA_SERVER": BINARY}
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", NODE, "--port", "0",
                                 "--server", "llama-server"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        status = wait_until(lambda: (s := serve.read_status(NODE)) and s["healthy"] and s["fresh"] and s,
                            timeout=180)
        assert status["kind"] == "llama-server" and status["config_version"] == 0
        assert status["llama_build"] == llamatools.identity(BINARY)  # the build, recorded with what it serves
        assert complete(status).strip()  # the OpenAI API answers, with generated text

        nodeconfig.write(NODE, payload(sha256, 1, 1))
        switched = wait_until(lambda: (s := serve.read_status(NODE)) and s["config_version"] == 1 and s["healthy"]
                              and s, timeout=180)
        assert switched["pid"] != status["pid"] and switched["params"]["n_threads"] == 1
        assert switched["address"] == status["address"]  # the same port: clients need not know
        cmdline = Path(f"/proc/{switched['pid']}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"-t") + 1] == b"1"  # the config's flags are the server's
        assert complete(switched).strip()

        # 32 tokens: the fastest full request must outlast the fastest one-token one by more than a
        # loaded machine's jitter (8 gave no tg figure once, beside the full suite on 2 cores)
        figures = probe.probe(switched["address"], switched["model"], 64, 32, n_requests=3)
        assert figures["errors"] == 0 and figures["best_pp_tps"] > 0 and figures["best_tg_tps"] > 0
        # the streamed load a llama-server canary is judged by (agent.load_served): every token streamed
        spec = LoadSpec(prompt_tokens=64, gen_tokens=32, concurrency=1, max_requests=100,
                        vocab_size=read_model_info(model_path).n_vocab)
        streamed = timedload.run_for(switched["address"], spec, 3.0, switched["model"]).records
        assert streamed and all(r.ok and r.gen_tokens == 32 and r.itl_s > 0 for r in streamed), streamed

        os.kill(switched["pid"], signal.SIGKILL)  # the server dies: the supervisor starts it again
        back = wait_until(lambda: (s := serve.read_status(NODE)) and s["pid"] != switched["pid"] and s["healthy"]
                          and s, timeout=180)
        assert back["restarts"] == 1 and back["config_version"] == 1 and complete(back).strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        nodeconfig.write(NODE, None)
    assert serve.read_status(NODE) is None  # the supervisor said it stopped serving
