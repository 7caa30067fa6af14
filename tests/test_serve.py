"""`fleettune serve` for real: SmolLM2 in llama-cpp-python's server, a steady request loop from the
`openai` client, config changes under load with no failed request, a killed server restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import wait_until
from workers import nodeconfig, serve
from workers.models import read_model_info

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
NODE = "5e" * 16  # a node id of our own: no Ray needed to serve a config file


def payload(sha256: str, version: int, n_threads: int, expected: float = 10.0) -> dict:
    return {"version": version, "rollout_id": version, "model_sha256": sha256, "model_name": "smollm2",
            "objective": "tg", "expected_tps": expected, "workload": {"n_prompt": 16, "n_gen": 8},
            "params": {"n_gpu_layers": 0, "n_threads": n_threads, "n_batch": 64, "n_ubatch": 64,
                       "flash_attn": False, "n_threads_batch": None}}


class RequestLoop:
    """Clients sending completions until stopped (at most ``max_requests`` each, ``max_s`` in all)."""

    def __init__(self, base_url: str, model: str, clients: int = 2, max_requests: int = 300,
                 max_s: float = 240) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
        self.model, self.max_requests, self.deadline = model, max_requests, time.monotonic() + max_s
        self.ok, self.failures = 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, seed: int) -> None:
        for i in range(self.max_requests):
            if self._stop.is_set() or time.monotonic() > self.deadline:
                return
            try:
                self.client.completions.create(model=self.model, prompt=f"Story {seed}-{i}: once upon a time",
                                               max_tokens=8, temperature=0)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                self.failures.append(f"{type(exc).__name__}: {exc} ({exc.__cause__!r})")

    def __enter__(self) -> RequestLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


@pytest.fixture
def served(model_path, tmp_path):
    """`fleettune serve` on NODE (port chosen by the OS); yields (process, status)."""
    env = dict(os.environ)
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", NODE, "--port", "0",
                                 "--server", "llama-cpp-python"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        status = wait_until(lambda: (s := serve.read_status(NODE)) and s["healthy"] and s["fresh"] and s,
                            timeout=120)
        yield proc, status
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        nodeconfig.write(NODE, None)


def test_config_changes_under_load_drop_no_request_and_a_killed_server_comes_back(served, model_path):
    proc, status = served
    sha256 = read_model_info(model_path).sha256
    assert status["config_version"] == 0 and status["kind"] == "llama-cpp-python"
    with RequestLoop(status["address"], status["model"]) as loop:
        wait_until(lambda: loop.ok >= 3, timeout=60)
        for version, threads in ((1, 1), (2, 2)):
            before = loop.ok
            nodeconfig.write(NODE, payload(sha256, version, threads))
            wait_until(lambda v=version: (serve.read_status(NODE) or {}).get("config_version") == v, timeout=120)
            wait_until(lambda b=before: loop.ok >= b + 3, timeout=60)  # served by the new config
    assert loop.failures == [] and loop.ok >= 9
    now = wait_until(lambda: (s := serve.read_status(NODE))["draining"] == 0 and s, timeout=120)  # old one gone
    assert now["params"]["n_threads"] == 2

    os.kill(now["pid"], signal.SIGKILL)  # the server dies: the supervisor starts it again
    back = wait_until(lambda: (s := serve.read_status(NODE)) and s["pid"] != now["pid"] and s["healthy"] and s,
                      timeout=120)
    assert back["restarts"] == 1 and back["config_version"] == 2
    assert proc.poll() is None


def test_a_bad_config_file_never_stops_the_supervisor_and_the_server_keeps_its_last_good_config(served,
                                                                                                 model_path):
    proc, status = served
    sha256 = read_model_info(model_path).sha256
    nodeconfig.write(NODE, payload(sha256, 1, 2))
    good = wait_until(lambda: (s := serve.read_status(NODE)) and s["config_version"] == 1 and s["healthy"]
                      and s["draining"] == 0 and s, timeout=120)
    text = nodeconfig.path_for(NODE).read_text()
    bad_files = {"truncated": text[: len(text) // 2], "empty": "", "list": f"[{text}]",
                 "no params": text.replace('"params"', '"parameters"'),
                 "injected": text.replace('"n_threads": 2', '"n_threads": "4 --host 0.0.0.0"')}
    for kind, bad in bad_files.items():
        nodeconfig.path_for(NODE).write_text(bad)  # a hand edit, a torn copy: no writer of ours
        said = wait_until(lambda: (s := serve.read_status(NODE)) and s["config_error"] and s["fresh"] and s,
                          timeout=30)
        assert "\n" not in said["config_error"] and NODE[:12] in said["config_error"], kind
        assert proc.poll() is None and said["pid"] == good["pid"] and said["config_version"] == 1, kind
        assert said["switching_to"] is None and said["params"] == good["params"], kind
    with urllib.request.urlopen(status["address"] + "/models", timeout=30) as answer:
        assert answer.status == 200  # still serving, on the last good config
    nodeconfig.write(NODE, payload(sha256, 2, 1), only_if=[payload(sha256, 1, 2)])  # replaces the bad file
    back = wait_until(lambda: (s := serve.read_status(NODE)) and s["config_version"] == 2 and s["healthy"] and s,
                      timeout=120)
    assert back["config_error"] is None and back["restarts"] == 0 and proc.poll() is None
