"""No measuring process outlives its trial: real processes killed with real signals.

A trial's llama.cpp measurement runs in a child process in its own session (workers/bench.py).
Whoever started it may die at any moment: a parent SIGKILLed or SIGTERMed, Ctrl-C of `fleettune
bench`, a raylet or a driver SIGKILLed, a Ray force-cancel (which on macOS does not kill children).
Each test runs the real SmolLM2 on a workload long enough to be caught mid-measurement, marks its
measuring processes with a unique value in their environment (so other developers' runs on this
machine never count), kills, and requires that no marked `workers.bench` process is left five
seconds later.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.conftest import wait_until
from workers.trial import BenchParams, TrialSpec, Workload

MARKER = "FLEETTUNE_TEST_MARKER"
GONE_WITHIN_S = 5.0
# about a minute of generation per repetition on one thread: still running whenever we kill it
LONG = Workload(n_prompt=0, n_gen=8000, reps=50, warmup=False)

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")


def measuring(marker: str) -> list[int]:
    """Live (not zombie) measuring processes whose environment carries ``marker``: `workers.bench`
    run on a trial's spec.json (not a parent that merely imports workers.bench)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(b"workers.bench" in arg for arg in argv) or not any(
                    arg.endswith(b"/spec.json") for arg in argv):
                continue
            if f"{MARKER}={marker}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile
        if state != "Z":
            found.append(int(entry.name))
    return found


def loaded(marker: str) -> list[int]:
    """The marked measuring processes that have the model mapped: past start-up, measuring."""
    pids = []
    for pid in measuring(marker):
        with contextlib.suppress(OSError):
            if b".gguf" in Path(f"/proc/{pid}/maps").read_bytes():
                pids.append(pid)
    return pids


def long_spec(model_info, key: str) -> TrialSpec:
    return TrialSpec(model_info.path, model_info.sha256, BenchParams(n_threads=1, n_batch=8, n_ubatch=8),
                     LONG, timeout_s=600, trial_key=key)


def marked_env(marker: str) -> dict:
    return {**os.environ, MARKER: marker}


def assert_none_left(marker: str) -> None:
    wait_until(lambda: not measuring(marker), timeout=GONE_WITHIN_S, interval=0.05)


PARENT = """
import json, sys
from workers.bench import measure
from workers.trial import BenchParams, TrialSpec, Workload
data = json.loads(sys.argv[1])
data["params"] = BenchParams(**data["params"]); data["workload"] = Workload(**data["workload"])
measure(TrialSpec(**data))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_measurement_dies_with_the_process_that_started_it(model_info, sig):
    marker = uuid.uuid4().hex
    spec = long_spec(model_info, "parent-" + marker[:8])
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(asdict(spec))],
                              env=marked_env(marker), start_new_session=True)
    try:
        wait_until(lambda: loaded(marker), timeout=120)
        parent.send_signal(sig)  # the parent only: the child has a session of its own
        assert parent.wait(timeout=30) == -sig
        assert_none_left(marker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def sigint_as_a_terminal() -> None:
    """In the child: Ctrl-C's default action, whatever the test run inherited (a shell starts a
    background job with SIGINT ignored, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_of_fleettune_bench_stops_the_measurement(model_path, sqlite_url):
    marker = uuid.uuid4().hex
    args = [sys.executable, "-m", "orchestrator.cli", "bench", str(model_path), "-t", "1", "-b", "8",
            "-p", "0", "-n", str(LONG.n_gen), "-r", str(LONG.reps), "--db", sqlite_url]
    proc = subprocess.Popen(args, env=marked_env(marker), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=sigint_as_a_terminal)
    try:
        wait_until(lambda: loaded(marker), timeout=120)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to its foreground group
        proc.wait(timeout=30)
        assert_none_left(marker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_child_exits_when_its_lifeline_closes(model_info, tmp_path):
    """The portable mechanism alone (macOS has no parent-death signal): this test stays the
    child's parent, a separate process holds the pipe's only write end, and killing that process
    must make the child exit by itself."""
    from workers.bench import PARENT_GONE_EXIT, child_argv

    marker = uuid.uuid4().hex
    spec = long_spec(model_info, "pipe-" + marker[:8])
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    read_end, write_end = os.pipe()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE, pass_fds=(write_end,))
    os.close(write_end)
    child = subprocess.Popen(child_argv(spec_path, result_path, read_end, spec.trial_key),
                             env=marked_env(marker), pass_fds=(read_end,), start_new_session=True)
    os.close(read_end)
    try:
        wait_until(lambda: loaded(marker), timeout=120)
        holder.kill()
        holder.wait()
        assert child.wait(timeout=GONE_WITHIN_S) == PARENT_GONE_EXIT
        assert not result_path.exists()
    finally:
        holder.kill()
        holder.wait()
        child.kill()
        child.wait()


# ---------------------------------------------------------------- on a real Ray cluster


@pytest.fixture
def marked_node(request, ray_cluster):
    """A bench node of its own chip label added to the session cluster; every process it starts
    (raylet, workers, measuring children) carries a fresh marker in its environment.

    Parametrised indirectly with Ray's own killing of a worker's children on or off: off is what
    Ray does on macOS, where only our own mechanisms stop the measurement."""
    from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL

    cluster = ray_cluster["cluster"]
    marker = uuid.uuid4().hex
    chip = f"orphan-test-{marker[:8]}"
    env = {MARKER: marker}
    if not getattr(request, "param", True):
        env["RAY_kill_child_processes_on_worker_exit"] = "0"
    saved = {k: os.environ.get(k) for k in (MARKER, "RAY_kill_child_processes_on_worker_exit")}
    os.environ.update(env)
    try:
        node = cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1}, labels={CHIP_LABEL: chip})
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    cluster.wait_for_nodes()
    yield {"node": node, "chip": chip, "marker": marker}
    with contextlib.suppress(Exception):
        cluster.remove_node(node, allow_graceful=True)  # a forced removal is reported later, into another test


def kill_raylet(node, capsys) -> None:
    """SIGKILL a node's raylet; then wait for Ray's two reports of it ("Raylet is terminated", and
    the node "marked dead" once its health checks failed), which this session's driver prints to
    stdout, so that they land in this test, not in the output of a later one that parses it."""
    from ray._private import ray_constants

    os.kill(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid, signal.SIGKILL)
    printed: list[str] = []

    def reported() -> bool:
        printed.append(capsys.readouterr().out)
        text = "".join(printed)
        return "Raylet is terminated" in text and f"node id: {node.node_id}" in text

    wait_until(reported, timeout=60, interval=0.05)


@pytest.mark.cluster
def test_a_killed_raylet_leaves_no_measurement(marked_node, model_info, capsys):
    from orchestrator.dispatch import RayDispatcher

    marker = marked_node["marker"]
    dispatcher = RayDispatcher()
    ref = dispatcher.submit(long_spec(model_info, "raylet-" + marker[:8]), marked_node["chip"])
    wait_until(lambda: loaded(marker), timeout=120)
    kill_raylet(marked_node["node"], capsys)
    assert_none_left(marker)
    assert dispatcher.result(ref, "k").error == "node lost"


@pytest.mark.cluster
@pytest.mark.parametrize("marked_node", [True, False], ids=["ray-kills-children", "as-on-macos"],
                         indirect=True)
def test_a_killed_driver_leaves_no_measurement(marked_node, model_info, ray_cluster):
    marker = marked_node["marker"]
    spec = long_spec(model_info, "driver-" + marker[:8])
    code = (
        "import json, sys, ray\n"
        "from orchestrator.dispatch import RayDispatcher\n"
        "from workers.trial import BenchParams, TrialSpec, Workload\n"
        "data = json.loads(sys.argv[1])\n"
        "data['params'] = BenchParams(**data['params']); data['workload'] = Workload(**data['workload'])\n"
        f"ray.init(address={ray_cluster['address']!r}, log_to_driver=False, logging_level='ERROR')\n"
        f"ray.get(RayDispatcher().submit(TrialSpec(**data), {marked_node['chip']!r}))\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code, json.dumps(asdict(spec))],
                              env={**os.environ, **ray_cluster["env"]}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: loaded(marker), timeout=180)
        driver.kill()
        driver.wait()
        assert_none_left(marker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


@pytest.mark.cluster
@pytest.mark.parametrize("marked_node", [True, False], ids=["ray-kills-children", "as-on-macos"],
                         indirect=True)
def test_ray_force_cancel_leaves_no_measurement(marked_node, model_info):
    """What a paused or abandoned trial gets (studies cancel their refs with force=True)."""
    from orchestrator.dispatch import RayDispatcher

    marker = marked_node["marker"]
    dispatcher = RayDispatcher()
    ref = dispatcher.submit(long_spec(model_info, "cancel-" + marker[:8]), marked_node["chip"])
    wait_until(lambda: loaded(marker), timeout=120)
    dispatcher.cancel(ref)
    assert_none_left(marker)
    assert dispatcher.result(ref, "k").error in ("interrupted", "node lost")


SIGINT_AT_THE_WORST_INSTANT = r"""
import signal, subprocess, sys, threading
from pathlib import Path
from workers import bench
from workers.trial import BenchParams, TrialSpec, Workload

class SigintRightAfterAcquire:
    '''A real lock; Ctrl-C arrives at the instant a non-blocking acquire has succeeded, before the
    `try` of Popen.wait(timeout) that releases it (a window the scheduler can hit under load).'''
    def __init__(self):
        self.lock, self.polls = threading.Lock(), 0
    def acquire(self, blocking=True, timeout=-1):
        got = self.lock.acquire(blocking, timeout)
        if got and not blocking:
            self.polls += 1
            if self.polls == 3:
                signal.raise_signal(signal.SIGINT)
        return got
    def release(self):
        self.lock.release()
    def __enter__(self):
        return self.acquire()
    def __exit__(self, *exc):
        self.release()

original = subprocess.Popen.__init__
def instrumented(self, *args, **kwargs):
    original(self, *args, **kwargs)
    self._waitpid_lock = SigintRightAfterAcquire()
subprocess.Popen.__init__ = instrumented

model = Path(sys.argv[1])
model.write_bytes(b"GGUF" + bytes(60))  # the child starts, finds another file, and ends; not before the signal
spec = TrialSpec(str(model), "0" * 64, BenchParams(n_threads=1, n_batch=8, n_ubatch=8),
                 Workload(n_prompt=0, n_gen=4, reps=1, warmup=False), timeout_s=60, trial_key="sigint")
try:
    bench.measure(spec)
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(0)
print("not interrupted")
sys.exit(1)
"""


def test_ctrl_c_at_the_instant_popen_holds_its_wait_lock_still_stops(tmp_path):
    """Issue 24: a SIGINT raised between Popen.wait's non-blocking lock acquire and its `try` left
    the lock held, and the clean-up's wait() blocked for ever. Measuring takes Ctrl-C over while it
    waits: the handler kills the child and the KeyboardInterrupt comes after the wait."""
    done = subprocess.run([sys.executable, "-c", SIGINT_AT_THE_WORST_INSTANT, str(tmp_path / "m.gguf")],
                          capture_output=True, text=True, timeout=30, cwd=Path(__file__).parent.parent,
                          start_new_session=True, preexec_fn=sigint_as_a_terminal)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done.stdout + done.stderr
