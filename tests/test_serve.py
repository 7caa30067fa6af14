"""`fleettune serve` for real: SmolLM2 in llama-cpp-python's server, a steady request loop from the
`openai` client, config changes under load with no failed request, a killed server restarted;
concurrent streamed and plain requests with none cut, the server gone with a SIGKILLed supervisor,
a model llama.cpp cannot load given up on after a bounded number of restarts (issue 24)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bench.serve_load import RoundRobinLoop, port_free
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


def test_the_server_process_is_given_the_nodes_config_field_for_field(served, model_path):
    """Rule 21.1: a served config equals the node's config, K/V cache types included (the server's
    ModelSettings once left them out, so a recommended q8_0 cache was served as f16)."""
    from llama_cpp.server.settings import ModelSettings

    from workers import knobs
    from workers.trial import BenchParams

    _, status = served
    sha256 = read_model_info(model_path).sha256
    config = payload(sha256, 1, 1)
    config["params"].update(flash_attn=True, type_k="q8_0", type_v="q8_0")
    nodeconfig.write(NODE, config)
    now = wait_until(lambda: (s := serve.read_status(NODE)) and s["config_version"] == 1 and s["healthy"]
                     and s["draining"] == 0 and s, timeout=180)
    argv = Path(f"/proc/{now['pid']}/cmdline").read_bytes().split(b"\0") if sys.platform.startswith("linux") else []
    if not argv:
        pytest.skip("reads the server's command line from /proc")
    given = BenchParams.from_dict(json.loads(argv[argv.index(b"--params") + 1]))
    assert given == BenchParams.from_dict(config["params"])
    settings = ModelSettings(model=str(model_path), **knobs.server_settings(given))
    wanted = {k.server_field: k.to_python(getattr(given, k.field)) for k in knobs.KNOBS
              if k.server_field and not k.same_as}
    assert {field: getattr(settings, field) for field in wanted} == wanted
    assert settings.type_k == settings.type_v == knobs.GGML_TYPES["q8_0"] and settings.flash_attn is True

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


def test_concurrent_streamed_and_plain_requests_cut_none(served):
    """Four clients, every other request streamed: llama-cpp-python's default (interrupt_requests)
    ended a running stream whenever another request arrived; now each waits its turn."""
    _, status = served
    with RoundRobinLoop([status], max_requests=40, max_s=240, clients=4, streamed=True) as loop:
        wait_until(lambda: loop.ok + len(loop.failures) >= 40, timeout=240)
    assert loop.failures == [] and loop.ok == 40 and loop.streams_ok == 20



def test_config_switches_under_streamed_and_plain_load_cut_no_stream(served, model_path):
    """A switch retires the old server with SIGTERM: its open streams finish (sse-starlette ended
    them at once, cutting streamed requests mid-body), and plain requests are served throughout."""
    _, status = served
    sha256 = read_model_info(model_path).sha256
    with RoundRobinLoop([status], max_requests=400, max_s=400, clients=3, streamed=True) as loop:
        wait_until(lambda: loop.streams_ok >= 2, timeout=120)
        for version, threads in ((1, 1), (2, 2), (3, 1)):
            before = loop.ok
            nodeconfig.write(NODE, payload(sha256, version, threads))
            wait_until(lambda v=version: (s := serve.read_status(NODE) or {}).get("config_version") == v
                       and s.get("draining") == 0, timeout=180)
            wait_until(lambda b=before: loop.ok >= b + 3, timeout=120)  # served by the new config
    assert loop.failures == [] and loop.streams_ok >= 3

def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (a container's init may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False



def start_serve(model_path: Path, port: int, log: Path, node: str = NODE) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", node, "--port",
                                 str(port), "--server", "llama-cpp-python"], stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_supervisor_takes_its_server_along_and_a_new_serve_gets_the_port(model_path, tmp_path):
    first = start_serve(model_path, 0, tmp_path / "serve.log")
    second = None
    try:
        status = wait_until(lambda: (s := serve.read_status(NODE)) and s["healthy"] and s["fresh"] and s,
                            timeout=120)
        port, child = int(status["address"].rsplit(":", 1)[1].split("/")[0]), status["pid"]
        first.kill()  # SIGKILL: no clean-up of its own (an OOM kill, a crash)
        first.wait()
        wait_until(lambda: not alive(child), timeout=10)
        wait_until(lambda: port_free(port), timeout=10)
        second = start_serve(model_path, port, tmp_path / "serve.log")  # what launchd/systemd do next
        again = wait_until(lambda: (s := serve.read_status(NODE)) and s["supervisor_pid"] == second.pid
                           and s["healthy"] and s, timeout=120)
        assert again["address"] == status["address"] and second.poll() is None
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)


def test_a_server_child_exits_when_its_lifeline_closes(model_path, tmp_path):
    """The portable mechanism alone (macOS has no parent-death signal): this test stays the
    child's parent; another process holds the lifeline's only write end and is killed."""
    from workers.bench import PARENT_GONE_EXIT

    read_end, write_end = os.pipe()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=(write_end,))
    os.close(write_end)
    sock = socket.create_server(("127.0.0.1", 0))
    ready_r, ready_w = os.pipe()
    argv = serve.LlamaCppPython().argv(str(model_path), "smollm2", serve.BenchParams.from_dict(serve.DEFAULT_PARAMS),
                                       listen_fd=sock.fileno(), ready_fd=ready_w, port=None, parent_fd=read_end)
    child = subprocess.Popen(argv, pass_fds=(sock.fileno(), ready_w, read_end), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_end)
    os.close(ready_w)
    sock.close()
    try:
        assert os.read(ready_r, 1) == b"1"  # loaded and accepting
        holder.kill()
        holder.wait()
        assert child.wait(timeout=10) == PARENT_GONE_EXIT
    finally:
        os.close(ready_r)
        for proc in (holder, child):
            proc.kill()
            proc.wait()


def test_the_keeper_stops_its_command_when_the_lifeline_closes():
    """Where llama-server cannot get a parent-death signal (macOS), a keeper process runs it and
    stops it when the supervisor's lifeline closes."""
    read_end, write_end = os.pipe()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=(write_end,))
    os.close(write_end)
    keeper = subprocess.Popen([sys.executable, "-m", "workers.serve", "--keep", "--parent-pipe", str(read_end), "--",
                               sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"],
                              pass_fds=(read_end,), stdout=subprocess.PIPE, text=True)
    os.close(read_end)
    try:
        command = int(keeper.stdout.readline())
        assert alive(command)
        holder.kill()
        holder.wait()
        keeper.wait(timeout=10)
        wait_until(lambda: not alive(command), timeout=10)
    finally:
        holder.kill()
        holder.wait()
        keeper.kill()
        keeper.wait()


def unloadable_copy(model_path: Path, out: Path) -> Path:
    """SmolLM2 with its architecture renamed: our GGUF reader accepts it, llama.cpp does not."""
    data = bytearray(model_path.read_bytes())
    from gguf import GGUFReader

    header_end = GGUFReader(model_path).data_offset
    head = bytes(data[:header_end]).replace(b"llama.", b"llamz.").replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                                         b"\x05\x00\x00\x00\x00\x00\x00\x00llamz")
    out.write_bytes(head + bytes(data[header_end:]))
    return out


def test_a_model_llama_cpp_cannot_load_is_given_up_after_a_few_restarts(model_path, tmp_path):
    bad = unloadable_copy(model_path, tmp_path / "unloadable.gguf")
    assert read_model_info(bad).architecture == "llamz"
    node = "6f" * 16
    log = tmp_path / "serve.log"
    started = time.monotonic()
    proc = start_serve(bad, 0, log, node=node)
    try:
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - started
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert code == 2, lines
    assert lines[-1].startswith("error: the llama-cpp-python server died 6 times in a row"), lines
    # the backoff: 0.5 + 1 + 2 + 4 + 8 s between the six starts, not 39 restarts in 30 s
    assert took >= sum(serve.RESTART_BACKOFF_S * 2 ** i for i in range(serve.RESTART_LIMIT - 1))
    assert serve.read_status(node) is None  # nothing left saying it serves


def test_serve_with_an_unreachable_head_says_so_in_one_line(model_path):
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # bound and closed below: nothing listens there
    started = time.monotonic()
    result = subprocess.run([FLEETTUNE, "serve", "--model", str(model_path), "--address", f"127.0.0.1:{port}",
                             "--port", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and time.monotonic() - started < 30
    assert result.stderr.strip().splitlines() == [f"error: cannot reach the Ray cluster at 127.0.0.1:{port}: "
                                                  "Connection refused"], result.stderr
