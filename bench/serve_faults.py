"""Faults injected into serving nodes under load, then what every node serves checked against the
rollout history (issue 24), in the style of bench/faults.py.

A real Ray cluster (``ray.cluster_utils.Cluster``: a head and ``--nodes`` raylets of this machine's
chip), one real `fleettune serve` of SmolLM2-135M per node (llama-cpp-python's server on a fixed
loopback port, as a service would run it), a results database holding one real recommendation,
and a bounded loop of concurrent streamed and plain requests (``bench.serve_load.RoundRobinLoop``)
to every node for the whole run. Rollouts are operator's pins (``rollout start --params``, a
generous tolerance so that they promote) driven by real `fleettune rollout` processes: the head.

Kinds of fault:

- ``supervisor SIGKILL``: a node's `fleettune serve` is killed with SIGKILL (during a rollout half
  the time); its server must be gone and its port free within ``GONE_WITHIN_S``, then a new `serve`
  is started on the same port (what launchd or systemd do);
- ``server child SIGKILL``: the server process itself; the supervisor starts it again;
- ``corrupt config mid-rollout``: while a rollout runs, a node's config file is overwritten with a
  truncated, empty, list-shaped or params-less file;
- ``head killed mid-rollout``: the `rollout start` process gets SIGKILL at a random instant after
  its first intent; the rollout is then resumed (`rollout start` again) or rolled back;
- ``two rollout drivers``: a second `rollout start` for the model while the first drives it; it
  must be refused (exit 2, one line) and the first must finish.

After each fault, once no rollout is running: every node serves (healthy, config version and
params) the config the rollout history says its chip runs (none before the first promotion), no
server process is left without its supervisor, no port is held by a dead supervisor's server, and
every supervisor the harness started is still running. Requests that failed during the fault are
counted (a killed supervisor's node drops what it was serving; nothing else should).

    python bench/serve_faults.py run [--short] [--faults 50] [--nodes 3] [--seed 1] [--progress FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serve_load import port_free  # noqa: E402 (after the path is set)

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
MARKER = "FLEETTUNE_SERVE_FAULTS"  # in the environment of every process the harness starts
GONE_WITHIN_S = 15.0  # a killed supervisor's server exits and frees the port within this
SETTLE_S = 180.0  # a node reaches the config the history says within this
ROLLOUT_TIMEOUT_S = 400.0
KINDS = ("supervisor SIGKILL", "server child SIGKILL", "corrupt config mid-rollout", "head killed mid-rollout",
         "two rollout drivers")
PINS = ("-t 1 -b 32 -ub 32", "-t 2 -b 64 -ub 64", "-t 1 -b 64 -ub 64", "-t 2 -b 32 -ub 32")
CORRUPTIONS = {"truncated": b'{"version": 3, "params": {"n_thr', "empty": b"", "list": b"[1, 2, 3]\n",
               "params-less": None}  # None: the current config without its params


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, interval: float = 0.2):
    """``condition()``'s first truthy value within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)  # polling a condition with a deadline


def marked_processes(marker: str) -> dict[int, tuple[int, str]]:
    """Live (not zombie) processes carrying ``marker``: pid -> (parent pid, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if f"{MARKER}={marker}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            found[int(entry.name)] = (int(stat[1]), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


@dataclass
class Tally:
    faults: Counter = field(default_factory=Counter)
    checked: Counter = field(default_factory=Counter)
    held: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)  # requests that failed during each kind's faults
    requests: int = 0
    problems: list[str] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    gone_s: list[float] = field(default_factory=list)  # supervisor SIGKILL to port free
    outcomes: Counter = field(default_factory=Counter)  # how the rollouts ended
    streams_ok: int = 0
    failure_samples: list[str] = field(default_factory=list)


class Fleet:
    """The cluster, the serving nodes, the database and the request loop."""

    def __init__(self, n_nodes: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.marker = uuid.uuid4().hex
        self.home = Path(tempfile.mkdtemp(prefix="fleettune-serve-faults-"))
        os.environ["FLEETTUNE_HOME"] = str(self.home)
        os.environ[MARKER] = self.marker
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.n_nodes = n_nodes
        self.tally = Tally()
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    # -- set-up

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from orchestrator.db import open_database
        from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL
        from orchestrator.studies import StudyConfig
        from orchestrator.tune import tune
        from workers.hardware import fingerprint_live
        from workers.models import fetch_known_model, read_model_info
        from workers.trial import Workload

        self.model_path = fetch_known_model("smollm2-135m", self.home / "models")
        self.model = read_model_info(self.model_path)
        self.chip = fingerprint_live().chip_key
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="ERROR")
        self.raylets = [self.cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1},
                                              labels={CHIP_LABEL: self.chip}) for _ in range(self.n_nodes)]
        self.cluster.wait_for_nodes()
        self.nodes = sorted(n.node_id for n in self.raylets)
        self.url = f"sqlite:///{self.home / 'results.db'}"
        self.db = open_database(self.url)
        tune(self.db, StudyConfig(model=self.model, objective="tg", n_trials=1, seed=1, confirm_top=1,
                                  workload=Workload(n_prompt=32, n_gen=8, reps=1)), chip_key=self.chip, warm=False)
        for node in self.nodes:
            self.ports[node] = _free_port()
            self.start_serve(node)
        for node in self.nodes:
            if not wait_for(lambda n=node: self.status(n, healthy=True), SETTLE_S):
                raise RuntimeError(f"node {node[:12]} did not start serving")

    def start_serve(self, node: str) -> None:
        with open(self.home / f"serve-{node[:8]}.log", "a") as log:
            self.procs[node] = subprocess.Popen(
                [FLEETTUNE, "serve", "--model", str(self.model_path), "--node-id", node, "--port",
                 str(self.ports[node]), "--server", "llama-cpp-python"], stdout=log, stderr=subprocess.STDOUT,
                env=self.env)

    def status(self, node: str, healthy: bool = False) -> dict | None:
        from workers import serve

        proc = self.procs[node]
        status = serve.read_status(node)
        if not status or not status["fresh"] or status["supervisor_pid"] != proc.pid:
            return None
        return status if status["healthy"] or not healthy else None

    def statuses(self) -> list[dict]:
        return [self.status(n) or {"address": f"http://127.0.0.1:{self.ports[n]}/v1", "model": self.model_path.stem}
                for n in self.nodes]

    def close(self) -> None:
        import ray

        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
        ray.shutdown()
        self.cluster.shutdown()

    # -- the head

    def rollout(self, *args: str) -> subprocess.Popen:
        argv = [FLEETTUNE, "rollout", *args, "--db", self.url]
        if args[0] in ("start", "rollback"):
            argv += ["--address", self.cluster.address]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)

    def start_rollout(self, pin: str | None = None) -> subprocess.Popen:
        """``rollout start`` of a pin (a new rollout), or without one (resumes an unfinished one)."""
        extra = ["--params", pin] if pin else []
        return self.rollout("start", "--model", str(self.model_path), "--canary", "30%", "--tolerance", "90%",
                            *extra)

    def finish(self, proc: subprocess.Popen, what: str, ok=(0,)) -> tuple[int, str]:
        try:
            out, err = proc.communicate(timeout=ROLLOUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [line for line in (err or "").strip().splitlines() if line.strip()]
        last = (lines or [""])[-1][:300]
        if proc.returncode not in ok:
            self.tally.problems.append(f"{what}: exit {proc.returncode}: {last}")
        return proc.returncode, last

    def rollout_rows(self) -> list[dict]:
        from orchestrator import rollout as ro

        with contextlib.suppress(Exception):
            return ro.status_rows(self.db)
        return []

    def unfinished(self) -> int | None:
        from orchestrator.db import repo

        with self.db.session() as s:
            rollout = repo.unfinished_rollout(s, self.model.sha256)
            return rollout.id if rollout else None

    def newest_rollout(self) -> int:
        from orchestrator.db import repo

        with self.db.session() as s:
            latest = repo.latest_rollout(s)
            return latest.id if latest else 0

    def wait_rollout_started(self, proc: subprocess.Popen, after: int) -> bool:
        """True once a rollout newer than ``after`` has a node past its intent."""
        return bool(wait_for(lambda: proc.poll() is not None or (
            self.newest_rollout() > after and any(r["state"] != "pending" for r in self.rollout_rows())), 120,
            interval=0.05)) and proc.poll() is None

    def expected(self) -> dict | None:
        from orchestrator.db import repo

        with self.db.session() as s:
            return repo.current_chip_configs(s, self.model.sha256).get(self.chip)

    # -- the checks

    def check(self, kind: str) -> None:
        """Every node serves what the history says; no orphan server; every supervisor running."""
        self.tally.checked[kind] += 1
        problems = []
        left = self.unfinished()
        if left is not None:
            problems.append(f"rollout {left} left unfinished")
        expected = self.expected()
        version = expected["version"] if expected else 0

        def serving_it(node: str) -> bool:
            status = self.status(node, healthy=True)
            return bool(status) and status["config_version"] == version and status["draining"] == 0 and (
                expected is None or status["params"] == expected["params"])

        for node in self.nodes:
            if self.procs[node].poll() is not None:
                problems.append(f"node {node[:12]}: supervisor exited {self.procs[node].returncode}: "
                                f"{self.last_log_line(node)}")
            elif not wait_for(lambda n=node: serving_it(n), SETTLE_S):
                status = self.status(node)
                problems.append(f"node {node[:12]} serves version {status and status['config_version']} "
                                f"(healthy {status and status['healthy']}), the history says {version}")
        supervisors = {p.pid for p in self.procs.values() if p.poll() is None}
        orphans = [f"{pid} ({cmd[:80]})" for pid, (ppid, cmd) in marked_processes(self.marker).items()
                   if "workers.serve" in cmd and ppid not in supervisors]
        if orphans:
            problems.append(f"server processes without their supervisor: {', '.join(orphans)}")
        if problems:
            self.tally.problems += [f"{kind}: {p}" for p in problems]
            self.repair()
        else:
            self.tally.held[kind] += 1

    def last_log_line(self, node: str) -> str:
        lines = [line for line in (self.home / f"serve-{node[:8]}.log").read_text(errors="replace").splitlines()
                 if line.strip()]
        return (lines or [""])[-1][:200]

    def repair(self) -> None:
        """Back to a known state after a failed check, so later faults are judged on their own:
        orphans killed, unfinished rollouts rolled back, each node's file the history's, every
        supervisor running."""
        from workers import nodeconfig

        supervisors = {p.pid for p in self.procs.values() if p.poll() is None}
        for pid, (ppid, cmd) in marked_processes(self.marker).items():
            if "workers.serve" in cmd and ppid not in supervisors:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.unfinished() is not None:
            self.finish(self.rollout("rollback"), "repair: rollout rollback")
        expected = self.expected()
        for node in self.nodes:
            with nodeconfig.locked(node):
                nodeconfig.path_for(node).unlink(missing_ok=True)
            if expected:
                nodeconfig.write(node, expected)
            if self.procs[node].poll() is not None:
                wait_for(lambda n=node: port_free(self.ports[n]), GONE_WITHIN_S)
                self.start_serve(node)
        for node in self.nodes:
            wait_for(lambda n=node: self.status(n, healthy=True), SETTLE_S)

    # -- the faults

    def rollout_to_end(self, proc: subprocess.Popen, what: str) -> None:
        code, line = self.finish(proc, what, ok=(0, 3))
        state = (self.rollout_rows() or [{}])[0].get("rollout_state", "?")
        self.tally.outcomes[state] += 1

    def kill_supervisor(self) -> None:
        node = self.rng.choice(self.nodes)
        during = self.rng.random() < 0.5
        before = self.newest_rollout()
        driver = self.start_rollout(self.rng.choice(PINS)) if during else None
        if driver:
            self.wait_rollout_started(driver, before)
            time.sleep(self.rng.uniform(0.0, 3.0))  # a random instant of the rollout, not a synchronisation
        status = self.status(node) or {}
        proc = self.procs[node]
        killed = time.monotonic()
        proc.kill()
        proc.wait()
        self.tally.faults["supervisor SIGKILL"] += 1
        child = status.get("pid")
        gone = wait_for(lambda: port_free(self.ports[node]) and not (
            child and child in marked_processes(self.marker)), GONE_WITHIN_S, interval=0.05)
        if gone:
            self.tally.gone_s.append(time.monotonic() - killed)
        else:
            self.tally.problems.append(f"supervisor SIGKILL: node {node[:12]}: port {self.ports[node]} still held "
                                       f"or server {child} alive {GONE_WITHIN_S:g} s after the kill")
            self.repair()
        self.start_serve(node)  # what the service manager does
        if driver:
            self.rollout_to_end(driver, "rollout under a supervisor kill")
            if self.unfinished() is not None:  # the killed node failed the rollout's apply or probe
                self.finish(self.rollout("rollback"), "rollback after a supervisor kill")

    def kill_child(self) -> None:
        node = self.rng.choice(self.nodes)
        status = self.status(node, healthy=True) or wait_for(lambda: self.status(node, healthy=True), SETTLE_S)
        if not status:
            self.tally.harness_errors.append(f"node {node[:12]} not serving before a child kill")
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(status["pid"], signal.SIGKILL)
        self.tally.faults["server child SIGKILL"] += 1
        wait_for(lambda: (s := self.status(node, healthy=True)) and s["pid"] != status["pid"], SETTLE_S)

    def corrupt_config(self) -> None:
        from workers import nodeconfig

        before = self.newest_rollout()
        driver = self.start_rollout(self.rng.choice(PINS))
        if not self.wait_rollout_started(driver, before):
            self.tally.harness_errors.append("corrupt config: the rollout ended before the fault")
            self.rollout_to_end(driver, "rollout (no fault)")
            return
        time.sleep(self.rng.uniform(0.0, 2.0))  # a random instant of the rollout
        node = self.rng.choice(self.nodes)
        name = self.rng.choice(sorted(CORRUPTIONS))
        content = CORRUPTIONS[name]
        if content is None:
            current = self.expected() or {"version": 1}
            content = json.dumps({k: v for k, v in current.items() if k != "params"}).encode()
        path = nodeconfig.path_for(node)
        with open(path.with_name(f".{node}.corrupt"), "wb") as handle:  # written, then renamed in
            handle.write(content)
        os.replace(path.with_name(f".{node}.corrupt"), path)
        self.tally.faults["corrupt config mid-rollout"] += 1
        self.rollout_to_end(driver, f"rollout over a {name} config")
        if self.unfinished() is not None:
            self.finish(self.rollout("rollback"), "rollback after a corrupt config")

    def kill_head(self) -> None:
        before = self.newest_rollout()
        driver = self.start_rollout(self.rng.choice(PINS))
        if not self.wait_rollout_started(driver, before):
            self.tally.harness_errors.append("head kill: the rollout ended before the fault")
            self.rollout_to_end(driver, "rollout (no fault)")
            return
        time.sleep(self.rng.uniform(0.0, 8.0))  # a random instant: applies, canary analysis, waves
        if driver.poll() is not None:
            self.rollout_to_end(driver, "rollout (finished before its head kill)")
            return
        driver.kill()
        driver.wait()
        self.tally.faults["head killed mid-rollout"] += 1
        if self.unfinished() is not None:
            if self.rng.random() < 0.5:
                self.rollout_to_end(self.start_rollout(), "resume after a head kill")
            else:
                self.finish(self.rollout("rollback"), "rollback after a head kill")

    def two_drivers(self) -> None:
        before = self.newest_rollout()
        first = self.start_rollout(self.rng.choice(PINS))
        if not self.wait_rollout_started(first, before):
            self.tally.harness_errors.append("two drivers: the first ended before the second started")
            self.rollout_to_end(first, "rollout (no fault)")
            return
        second = self.start_rollout()  # "resume" the rollout the first is driving
        self.tally.faults["two rollout drivers"] += 1
        code, line = self.finish(second, "second driver", ok=(0, 2, 3))
        if code != 2 or first.poll() is not None:
            self.tally.problems.append(f"two rollout drivers: the second was not refused while the first ran "
                                       f"(exit {code}: {line})")
        self.rollout_to_end(first, "first driver")
        if self.unfinished() is not None:
            self.finish(self.rollout("rollback"), "rollback after two drivers")


def run(args) -> Tally:
    fleet = Fleet(args.nodes, args.seed)
    per_kind = 2 if args.short else -(-args.faults // len(KINDS))
    plan = [kind for kind in KINDS for _ in range(per_kind)]
    fleet.rng.shuffle(plan)
    actions = {"supervisor SIGKILL": fleet.kill_supervisor, "server child SIGKILL": fleet.kill_child,
               "corrupt config mid-rollout": fleet.corrupt_config, "head killed mid-rollout": fleet.kill_head,
               "two rollout drivers": fleet.two_drivers}
    from bench.serve_load import RoundRobinLoop

    try:
        fleet.start()
        first = fleet.start_rollout(PINS[0])  # a history to check against before the first fault
        fleet.rollout_to_end(first, "first rollout")
        fleet.check("before any fault")
        with RoundRobinLoop(fleet.statuses(), max_requests=10**6, max_s=args.max_s, clients=2, streamed=True,
                            timeout_s=60) as loop:
            for i, kind in enumerate(plan, 1):
                failed_before = len(loop.failures)
                try:
                    actions[kind]()
                    fleet.check(kind)
                except Exception as exc:  # noqa: BLE001 - the harness's own failure, reported
                    fleet.tally.harness_errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")
                fleet.tally.dropped[kind] += len(loop.failures) - failed_before
                if args.progress:
                    fleet.tally.requests, fleet.tally.streams_ok = loop.ok + len(loop.failures), loop.streams_ok
                    Path(args.progress).write_text(report(fleet.tally) + f"\n({i} of {len(plan)} done)")
            fleet.tally.requests = loop.ok + len(loop.failures)
            fleet.tally.streams_ok = loop.streams_ok
            fleet.tally.failure_samples = loop.failures[:5]
    finally:
        fleet.close()
    left = [f"{pid} ({cmd[:80]})" for pid, (_, cmd) in marked_processes(fleet.marker).items() if "workers.serve" in cmd]
    if left:
        fleet.tally.problems.append(f"after the run: server processes left: {', '.join(left)}")
    held = [port for port in fleet.ports.values() if not port_free(port)]
    if held:
        fleet.tally.problems.append(f"after the run: ports still held: {held}")
    return fleet.tally


def report(tally: Tally) -> str:
    lines = ["| fault | injected | checked | every node on the history's config, no orphan, no port held | "
             "requests failed |", "| --- | ---: | ---: | ---: | ---: |"]
    for kind in [*KINDS, "before any fault"]:
        if tally.faults[kind] or tally.checked[kind]:
            lines.append(f"| {kind} | {tally.faults[kind]} | {tally.checked[kind]} | "
                         f"{tally.held[kind]}/{tally.checked[kind]} | {tally.dropped[kind]} |")
    total = sum(tally.faults.values())
    lines.append(f"\n{total} faults of {sum(1 for k in KINDS if tally.faults[k])} kinds; {tally.requests} requests "
                 f"({tally.streams_ok} streams complete), {sum(tally.dropped.values())} failed; "
                 f"rollouts ended: {dict(tally.outcomes)}")
    if tally.gone_s:
        ordered = sorted(tally.gone_s)
        lines.append(f"supervisor SIGKILL to server gone and port free: median {ordered[len(ordered) // 2]:.2f} s, "
                     f"max {ordered[-1]:.2f} s")
    for sample in tally.failure_samples:
        lines.append(f"failed request (sample): {sample[:200]}")
    for problem in tally.problems:
        lines.append(f"PROBLEM: {problem}")
    for error in tally.harness_errors:
        lines.append(f"harness error (not an invariant): {error}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="inject faults into serving nodes and check them")
    r.add_argument("--short", action="store_true", help="two faults of each kind")
    r.add_argument("--faults", type=int, default=50, help="faults in all, spread evenly over the kinds")
    r.add_argument("--nodes", type=int, default=3)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--max-s", type=float, default=7200, help="the request loop's bound")
    r.add_argument("--progress", help="file the report so far is written to after each fault")
    args = parser.parse_args()
    started = time.monotonic()
    tally = run(args)
    print(report(tally))
    print(f"({time.monotonic() - started:.0f} s; python bench/serve_faults.py run "
          f"{'--short' if args.short else f'--faults {args.faults}'} --nodes {args.nodes} --seed {args.seed})")
    return 1 if tally.problems else 0


if __name__ == "__main__":
    sys.exit(main())
