"""The locked-down fleet under faults, across real (namespaced) hosts: a longer run than the tests.

Builds the test LAN of tests/netns.py (a head, three workers and an intruder host, each its own
network namespace on a bridge, 198.51.100.0/24), starts the head (with Ray's dashboard and job API
where `ray[default]` is installed) and joins w1 as a real node (this machine's chip, llama.cpp on
SmolLM2-135M) and w2, w3 as simulated M2 Ultras, with fleettune's own commands. Then:

- ``auth``: ``--rounds`` times, while a study runs (so the head also has a driver and Ray workers
  listening), every port the head listens on (per ``ss``) is knocked on from the intruder's host
  without a token and with a wrong one (tests/netns_probe.py); the right token is the control.
  Reported per port: refused N/N, and which of Ray's processes listens there.
- ``partitions``: ``--partitions`` studies on the simulated Macs (each of their trials takes
  ``--sim-trial-s``), each with one worker's cable pulled once a trial is seen running there
  (``ip link set DEV down`` on its bridge port), plugged back after the study, the worker
  restarted and rejoined. Every study is audited (orchestrator/audit.py).
- ``kills``: ``--kills`` SIGKILLs on the real node while it measures, in turn: the measuring
  child (`python -I -m workers.bench`), the study's driver (then `tune --resume`), the child
  again, w1's raylet (then w1 rejoins). Five seconds after each kill, every `workers.bench`
  process that should be gone is counted as an orphan: after a driver's kill, all of them; after
  a raylet's, those of its host; after a child's, that child and any whose parent is not a Ray
  worker. Every study is run to completion (`--resume` after a pause) and audited.

Needs root and iproute2; everything it creates is removed at the end, also on failure. Run:

    sudo .venv/bin/python bench/netns_fleet.py --rounds 3 --partitions 3 --kills 0
    sudo .venv/bin/python bench/netns_fleet.py --rounds 0 --partitions 0 --kills 12
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.netns import HEAD_ADDR, Lan, netns_available, wait_for  # noqa: E402
from tests.test_netns import (  # noqa: E402
    FLEETTUNE,
    SIM_CHIP,
    SIM_KEY,
    SIM_MODEL,
    TUNE,
    a_new_trial_on,
    give_token,
    head_env,
    head_listeners,
    join,
    measuring,
    ray_processes,
    start_head,
    trials_in_flight,
)

REFUSED = {"UNAUTHENTICATED", "401", "403"}
ORPHAN_AFTER_S = 5.0  # issue 14: no `workers.bench` process survives five seconds after a kill
REAL_WORKLOAD = ["--prompt-tokens", "64", "--gen-tokens", "96"]  # a few seconds a trial here
KILL_ORDER = ("child", "driver", "child", "raylet")


def progress(kind: str, entry: dict) -> None:
    """One line per fault as it happens (stderr), so a run cut short still says what it saw."""
    print(json.dumps({"event": kind, **entry}), file=sys.stderr, flush=True)


def bench_pids(host) -> list[int]:
    """Live (not zombie) measuring processes of ``host``: `workers.bench` run on a trial's spec."""
    out = []
    for pid in host.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(b"workers.bench" in a for a in argv) and any(a.endswith(b"spec.json") for a in argv):
            out.append(pid)
    return out


def parent_is_ray_worker(pid: int) -> bool:
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return b"ray::" in Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False


def orphans_at(killed_at: float, find) -> list[int]:
    """What ``find`` returns ``ORPHAN_AFTER_S`` after the kill: the claim is about that instant."""
    time.sleep(max(0.0, killed_at + ORPHAN_AFTER_S - time.monotonic()))  # the deadline; not a sync
    return find()


def audit(db: Path, name: str) -> dict:
    from orchestrator.audit import audit_study
    from orchestrator.db import open_database

    database = open_database(f"sqlite:///{db}")
    try:
        report = audit_study(database, name)
    finally:
        database.dispose()
    return {"study": name, "state": report.state, "budget": report.budget, "complete": report.complete,
            "failed": report.failed, "lost": report.lost, "duplicated": report.duplicated,
            "problems": report.problems}


def node_lost(db: Path, name: str) -> int:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return conn.execute("select count(*) from ft_trials t join ft_studies s on s.id = t.study_id "
                            "where s.name = ? and t.error = 'node lost'", (name,)).fetchone()[0]


class Fleet:
    """The LAN, its head and workers, and the studies run on them."""

    def __init__(self, lan: Lan, model: Path, chip: str, sim_trial_s: float) -> None:
        self.lan, self.model, self.chip, self.sim_trial_s = lan, model, chip, sim_trial_s
        self.db = lan.head.root / "bench.db"
        self.token_file: Path | None = None

    def start(self) -> None:
        _, self.token_file = start_head(self.lan)
        for host in self.lan.workers:
            self.join(host)

    def join(self, host) -> None:
        token = give_token(host, self.token_file)
        if host.name == "w1":  # the real node: this machine's chip, llama.cpp
            join(host, token)
        else:
            join(host, token, "--simulate", SIM_CHIP, "--trial-seconds", f"{self.sim_trial_s:g}")

    def rejoin(self, host) -> None:
        """A worker's service manager restarting it: what is left of its session goes, it joins again."""
        def gone() -> bool:
            host.kill_all()  # again: a daemon may have forked since the last look
            return not host.pids()

        wait_for(gone, 30, f"{host.name}'s processes gone")
        self.join(host)

    def study(self, name: str, trials: int, real: bool, resume: bool = False) -> subprocess.Popen:
        target = [str(self.model), "--chip", self.chip, *TUNE, *REAL_WORKLOAD] if real else \
            [SIM_MODEL, "--chip", SIM_KEY, *TUNE]
        args = ["tune", *target, "--db", f"sqlite:///{self.db}", "--study", name, "--trials", str(trials),
                "--seed", "7", *(["--resume"] if resume else [])]
        head = self.lan.head
        return head.spawn(FLEETTUNE, *args, env=head_env(head), log=head.root / f"{name}.log")

    def finish(self, driver: subprocess.Popen, name: str, trials: int, real: bool) -> dict:
        """Wait for the study's driver; resume a paused study (at most 3 times); audit it."""
        for _ in range(4):
            try:
                driver.wait(timeout=600)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(timeout=30)
            state = audit(self.db, name)["state"]
            if state == "complete":
                break
            driver = self.study(name, trials, real, resume=True)
        return audit(self.db, name)


def auth(fleet: Fleet, rounds: int, trials: int) -> dict:
    lan = fleet.lan
    intruder = lan.hosts["x"]
    per_port: dict = {}
    for i in range(rounds):
        name = f"auth-{i}"
        driver = fleet.study(name, trials, real=False)
        try:
            wait_for(lambda: any(measuring(w) for w in lan.workers[1:]), 180, "a trial on a simulated Mac")
            listeners = head_listeners(lan)
            ports = sorted({p for a, p, _ in listeners if not a.endswith("127.0.0.1")})
            who = {p: c for a, p, c in listeners if not a.endswith("127.0.0.1")}
            control = give_token(intruder, fleet.token_file)
            done = intruder.run(sys.executable, "-m", "tests.netns_probe", HEAD_ADDR, *map(str, ports),
                                "--token-file", str(control), env=intruder.env(PYTHONPATH=str(REPO)),
                                timeout=600)
            control.unlink()
        finally:
            driver.send_signal(signal.SIGTERM)  # paused; its ports close with it
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.wait(timeout=120)
            if driver.poll() is None:
                driver.kill()
            wait_for(lambda: not any(measuring(w) for w in lan.workers), 120, "the paused study's trials ending")
        for r in json.loads(done.stdout):
            # a driver's and a Ray worker's ports change from round to round: keyed by process
            key = f"{who.get(r['port'], '?')}: {r['service']}" if who.get(r["port"]) == "core worker" \
                else f"{r['port']} {who.get(r['port'], '?')}: {r['service']}"
            entry = per_port.setdefault(key, {"attempts": 0, "refused": 0, "control_served": 0})
            entry["attempts"] += 2
            entry["refused"] += (r.get("none") in REFUSED) + (r.get("wrong") in REFUSED)
            entry["control_served"] += r.get("right") not in REFUSED | {"not sent", None}
        progress("auth", {"round": i, "ports": len(ports)})
    return per_port


def partitions(fleet: Fleet, count: int, trials: int) -> list[dict]:
    out = []
    sims = fleet.lan.workers[1:]
    for i in range(count):
        victim = sims[i % len(sims)]
        name = f"partition-{i}"
        before = trials_in_flight(victim)
        driver = fleet.study(name, trials, real=False)
        try:
            a_new_trial_on(victim, before)  # this study's, not an earlier one's being cancelled
            victim.link(False)  # the cable pulled, mid-trial
            result = fleet.finish(driver, name, trials, real=False)
        finally:
            victim.link(True)
        out.append({"cut": victim.name, "node_lost": node_lost(fleet.db, name), **result})
        progress("partition", out[-1])
        fleet.rejoin(victim)
    return out


def kills(fleet: Fleet, count: int, trials: int) -> tuple[list[dict], list[dict]]:
    """``count`` kills on the real node, in KILL_ORDER, over as many studies as they take."""
    lan = fleet.lan
    w1 = lan.hosts["w1"]
    out: list[dict] = []
    audits: list[dict] = []
    names = (f"kill-{i}" for i in itertools.count())
    name, driver = None, None
    while len(out) < count:
        if driver is None or driver.poll() is not None:
            if name:
                audits.append(fleet.finish(driver, name, trials, real=True))
                progress("audit", audits[-1])
            name = next(names)
            driver = fleet.study(name, trials, real=True)
        d = driver
        found = wait_for(lambda d=d: bench_pids(w1) or d.poll() is not None, 300, "a measurement on w1")
        if d.poll() is not None:
            continue  # the study ended (or paused) first: finished above, or a new one started
        kind = KILL_ORDER[len(out) % len(KILL_ORDER)]
        if kind == "child":
            child = found[0]
            os.kill(child, signal.SIGKILL)
            at = time.monotonic()
            left = orphans_at(at, lambda c=child: [p for h in lan.workers for p in bench_pids(h)
                                                   if p == c or not parent_is_ray_worker(p)])
        elif kind == "driver":  # Ray ends the job's workers; their children must follow
            driver.kill()
            at = time.monotonic()
            driver.wait(timeout=60)
            left = orphans_at(at, lambda: [p for h in lan.workers for p in bench_pids(h)])
            driver = fleet.study(name, trials, real=True, resume=True)
        else:  # w1's raylet: its Ray workers lose their parent, their children must follow
            raylet = next(pid for pid, cmd in ray_processes(w1).items() if "raylet/raylet" in cmd)
            os.kill(raylet, signal.SIGKILL)
            at = time.monotonic()
            left = orphans_at(at, lambda: bench_pids(w1))
            fleet.rejoin(w1)
        out.append({"killed": kind, "study": name, "orphans": len(left)})
        progress("kill", out[-1])
        for pid in left:  # reported above; removed so the next kill starts clean
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if name:
        audits.append(fleet.finish(driver, name, trials, real=True))
        progress("audit", audits[-1])
    return out, audits


def real_chip_and_model() -> tuple[str, Path]:
    from workers.hardware import fingerprint_live
    from workers.models import fetch_known_model

    cache = Path(os.environ.get("FLEETTUNE_MODEL_CACHE", REPO / ".pytest_cache" / "d" / "models"))
    cache.mkdir(parents=True, exist_ok=True)
    return fingerprint_live().chip_key, fetch_known_model("smollm2-135m", cache)


def print_report(report: dict) -> None:
    auth_ = report["auth"]
    if auth_:
        attempts = sum(p["attempts"] for p in auth_.values())
        refused = sum(p["refused"] for p in auth_.values())
        print(f"unauthenticated attempts refused: {refused}/{attempts} on {len(auth_)} listening services")
        for port, p in sorted(auth_.items()):
            print(f"  {port}: refused {p['refused']}/{p['attempts']}, right token served {p['control_served']}")
    parts = report["partitions"]
    if parts:
        print(f"partitions injected: {len(parts)} (cut mid-trial, \"node lost\": "
              f"{sum(p['node_lost'] > 0 for p in parts)}); studies complete "
              f"{sum(p['state'] == 'complete' for p in parts)}/{len(parts)}; trials lost "
              f"{sum(p['lost'] for p in parts)}, duplicated {sum(p['duplicated'] for p in parts)}; "
              f"audit problems {sum(len(p['problems']) for p in parts)}")
    ks, audits = report["kills"], report["kill_studies"]
    if ks:
        print(f"kills: {len(ks)} ({dict(Counter(k['killed'] for k in ks))}); orphan workers.bench "
              f"processes {ORPHAN_AFTER_S:g} s later: {sum(k['orphans'] for k in ks)}")
        print(f"  studies: {len(audits)}, complete {sum(a['state'] == 'complete' for a in audits)}; "
              f"trials lost {sum(a['lost'] for a in audits)}, duplicated "
              f"{sum(a['duplicated'] for a in audits)}; audit problems {sum(len(a['problems']) for a in audits)}")
    for entry in [*parts, *audits]:
        for problem in entry["problems"]:
            print(f"  {entry['study']}: {problem}")
    print(f"wall: {report['seconds']} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="auth probes of every head port")
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--trials", type=int, default=6, help="each study's budget")
    parser.add_argument("--sim-trial-s", type=float, default=6.0, help="a simulated trial's duration")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if min(args.rounds, args.partitions, args.kills) < 0 or args.trials < 1 or args.sim_trial_s <= 0:
        print("error: counts must be >= 0, --trials >= 1, --sim-trial-s > 0", file=sys.stderr)
        return 2
    if why := netns_available():
        print(f"error: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still removes the LAN
    chip, model = real_chip_and_model()
    root = Path(tempfile.mkdtemp(prefix="ftb", dir="/tmp"))
    lan = Lan(root, workers=3, extra={"x": 66})
    started = time.monotonic()
    try:
        fleet = Fleet(lan, model, chip, args.sim_trial_s)
        fleet.start()
        report = {"auth": auth(fleet, args.rounds, 200),
                  "partitions": partitions(fleet, args.partitions, args.trials)}
        report["kills"], report["kill_studies"] = kills(fleet, args.kills, args.trials)
    finally:
        lan.close()
        shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - started)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
