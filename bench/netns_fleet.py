"""The locked-down fleet under faults, across real (namespaced) hosts: a longer run than the tests.

Builds the test LAN of tests/netns.py (a head, three workers and an intruder host, each its own
network namespace on a bridge, 198.51.100.0/24), starts the head and three simulated M2 Ultras
with fleettune's own commands, then:

- ``auth``: ``--rounds`` times, every port the head listens on (per ``ss``) is knocked on from the
  intruder's host without a token and with a wrong one (tests/netns_probe.py); the right token
  is the control. Reported: refused N/N per port.
- ``partitions``: ``--partitions`` studies, each with one worker's cable pulled mid-trial
  (``ip link set DEV down`` on its bridge port), plugged back after the study, the node restarted
  and rejoined. Reported: trials lost (complete < budget) and duplicated (two completed rows for
  one Optuna trial), "node lost" trials.
- ``kills``: ``--kills`` SIGKILLs alternating between the study's driver (then `tune --resume`)
  and a measuring worker's raylet (then the node rejoins). After each, no process may still be
  measuring without a live raylet and driver: reported as orphans.

Needs root and iproute2; everything it creates is removed at the end, also on failure. Run:

    sudo .venv/bin/python bench/netns_fleet.py --rounds 5 --partitions 3 --kills 6 --trials 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
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
    SIM_TIME_SCALE,
    TUNE,
    give_token,
    head_env,
    join,
    measuring,
    ray_processes,
    start_head,
)

REFUSED = {"UNAUTHENTICATED", "401", "403"}


def study_rows(db: Path, name: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return conn.execute(
            "select t.optuna_number, t.state, t.error from ft_trials t join ft_studies s on s.id = t.study_id "
            "where s.name = ? and t.phase = 'search'", (name,)).fetchall()


def tally(db: Path, name: str, budget: int) -> dict:
    rows = study_rows(db, name)
    complete = Counter(n for n, state, _ in rows if state == "complete")
    return {"complete": sum(complete.values()), "lost": max(budget - len(complete), 0),
            "duplicated": sum(c - 1 for c in complete.values() if c > 1),
            "node_lost": sum(err == "node lost" for _, _, err in rows)}


def rejoin(lan: Lan, host, token_file: Path) -> None:
    """A worker's service manager restarting it: what is left of its session goes, it joins again."""
    host.kill_all()
    join(host, give_token(host, token_file), "--simulate", SIM_CHIP, "--time-scale", SIM_TIME_SCALE)


def run_study(lan: Lan, db: Path, name: str, trials: int, resume: bool = False):
    args = ["tune", SIM_MODEL, "--chip", SIM_KEY, "--db", f"sqlite:///{db}", "--study", name, *TUNE,
            "--trials", str(trials), "--seed", "7", *(["--resume"] if resume else [])]
    return lan.head.spawn(FLEETTUNE, *args, env=head_env(lan.head), log=lan.head.root / f"{name}.log")


def auth(lan: Lan, token_file: Path, rounds: int) -> dict:
    intruder = lan.hosts["x"]
    per_port: dict = {}
    for _ in range(rounds):
        ports = sorted({p for a, p, _ in lan.head.listeners() if not a.endswith("127.0.0.1")})
        control = give_token(intruder, token_file)
        done = intruder.run(sys.executable, "-m", "tests.netns_probe", HEAD_ADDR, *map(str, ports),
                            "--token-file", str(control), env=intruder.env(PYTHONPATH=str(REPO)), timeout=600)
        control.unlink()
        for r in json.loads(done.stdout):
            entry = per_port.setdefault(f"{r['port']} {r['service']}", {"attempts": 0, "refused": 0,
                                                                        "control_served": 0})
            entry["attempts"] += 2
            entry["refused"] += (r.get("none") in REFUSED) + (r.get("wrong") in REFUSED)
            entry["control_served"] += r.get("right") not in REFUSED | {"not sent"}
    return per_port


def partitions(lan: Lan, token_file: Path, db: Path, count: int, trials: int) -> list[dict]:
    out = []
    for i in range(count):
        victim = lan.workers[i % len(lan.workers)]
        name = f"partition-{i}"
        driver = run_study(lan, db, name, trials)
        try:
            wait_for(lambda v=victim: measuring(v), 180, f"a trial on {victim.name}")
            victim.link(False)
            driver.wait(timeout=600)
        finally:
            victim.link(True)
        out.append({"cut": victim.name, "exit": driver.returncode, **tally(db, name, trials)})
        rejoin(lan, victim, token_file)
    return out


def kills(lan: Lan, token_file: Path, db: Path, count: int, trials: int) -> list[dict]:
    out = []
    for i in range(count):
        name = f"kill-{i}"
        driver = run_study(lan, db, name, trials)
        busy = wait_for(lambda: [w for w in lan.workers if measuring(w)], 180, "a trial running")
        if i % 2 == 0:  # the driver: Ray cancels its job's tasks; `tune --resume` continues
            driver.send_signal(signal.SIGKILL)
            driver.wait(timeout=60)
            kind = "driver"
            orphans = _orphans_after(lambda: sum(len(measuring(w)) for w in lan.workers))
            resumed = run_study(lan, db, name, trials, resume=True)
            resumed.wait(timeout=600)
        else:  # a measuring node's raylet: its trial is "node lost" and measured elsewhere
            victim = busy[0]
            raylet = next(pid for pid, cmd in ray_processes(victim).items() if "raylet/raylet" in cmd)
            signal_pid(raylet)
            kind = f"raylet of {victim.name}"
            orphans = _orphans_after(lambda v=victim: len(measuring(v)))
            driver.wait(timeout=600)
            rejoin(lan, victim, token_file)
        out.append({"killed": kind, "orphans": orphans, **tally(db, name, trials)})
    return out


def signal_pid(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)


def _orphans_after(count_measuring, deadline_s: float = 30.0) -> int:
    """Measuring processes still alive ``deadline_s`` after the kill (polled, so 0 returns early)."""
    end = time.monotonic() + deadline_s
    left = count_measuring()
    while left and time.monotonic() < end:
        time.sleep(0.5)  # polling a condition
        left = count_measuring()
    return left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if why := netns_available():
        print(f"error: {why}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="ftb", dir="/tmp"))
    lan = Lan(root, workers=3, extra={"x": 66})
    started = time.monotonic()
    try:
        _, token_file = start_head(lan)
        for w in lan.workers:
            join(w, give_token(w, token_file), "--simulate", SIM_CHIP, "--time-scale", SIM_TIME_SCALE)
        db = lan.head.root / "bench.db"
        report = {"auth": auth(lan, token_file, args.rounds),
                  "partitions": partitions(lan, token_file, db, args.partitions, args.trials),
                  "kills": kills(lan, token_file, db, args.kills, args.trials)}
    finally:
        lan.close()
        shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - started)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    attempts = sum(p["attempts"] for p in report["auth"].values())
    refused = sum(p["refused"] for p in report["auth"].values())
    print(f"unauthenticated attempts refused: {refused}/{attempts} on {len(report['auth'])} listening ports")
    for port, p in sorted(report["auth"].items()):
        print(f"  {port}: refused {p['refused']}/{p['attempts']}, right token served {p['control_served']}")
    parts = report["partitions"]
    print(f"partitions injected: {len(parts)}; trials lost {sum(p['lost'] for p in parts)}, "
          f"duplicated {sum(p['duplicated'] for p in parts)}, node lost {sum(p['node_lost'] for p in parts)}")
    ks = report["kills"]
    print(f"kills: {len(ks)} ({Counter(k['killed'].split(' of ')[0] for k in ks)}); orphan measuring "
          f"processes {sum(k['orphans'] for k in ks)}; trials lost {sum(k['lost'] for k in ks)}, "
          f"duplicated {sum(k['duplicated'] for k in ks)}")
    print(f"wall: {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
