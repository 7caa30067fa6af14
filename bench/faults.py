"""Fault injection into real studies, then the invariants (orchestrator/audit.py) checked.

Every fault is real: the study's driver is a separate process (``faults.py drive``: the study loop
``tune`` runs, over an in-process fleet of simulated Macs whose trials take real wall time) that
is killed with SIGKILL, sent SIGINT or SIGTERM, or left running while its database is restarted,
stopped past the retry window, or locked by another process; two drivers race for one study and
two new studies for one name. After each fault the study is resumed (``--resume``) to its
budget and audited: 0 results lost, 0 duplicated, every invariant held.

PostgreSQL faults use a private server (``initdb`` + ``pg_ctl`` in a temporary directory on its
own port); the shared server on 5432 is never touched.

    python bench/faults.py run --db sqlite --kills 50 --signals 24 --races 6 --db-faults 6 --node-losses 9
    python bench/faults.py run --db postgres --kills 50 --signals 24 --races 6 --db-faults 6 --node-losses 9
    (a group's count 0 skips it, so a long run can be split; --progress FILE keeps the report so far)
    python bench/faults.py drive --db URL [--study NAME] [--trials 30] [--nodes 4] [--resume]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXIT_OK, EXIT_BAD_INPUT, EXIT_PAUSED = 0, 2, 3
CHIPS = ("M2 Ultra/76", "M1 Pro/16", "M3 Max/40")
MODEL = "sim://llama2-7b/q4_0"


# ---------------------------------------------------------------- the driver (a real process)


def drive(args) -> int:
    """Run (or resume) one study per ``--chips`` chip over in-process simulated nodes."""
    from orchestrator.db import open_database
    from orchestrator.stopping import StopRequest, pause_on_signals
    from orchestrator.studies import ChipTarget, StudyConfig, StudyPaused, StudyRunner
    from orchestrator.tune import run_studies
    from orchestrator.virtual import VirtualFleet
    from workers import simulated
    from workers.errors import BadInput
    from workers.trial import Workload

    stop = StopRequest()
    with pause_on_signals(stop):
        try:
            db = open_database(args.db)
            runners = []
            for i, label in enumerate(CHIPS[: args.chips]):
                chip = simulated.parse_chip(label)
                fleet = VirtualFleet(chip, args.nodes, args.trial_s, prefix=f"chip{i}", seed=args.seed)
                target = ChipTarget(chip, {}, simulated=True)
                name = f"{args.study}-{i}" if args.study and args.chips > 1 else args.study
                cfg = StudyConfig(model=simulated.sim_model_info(MODEL), workload=Workload(512, 128, 1),
                                  n_trials=args.trials, sampler=args.sampler, seed=args.seed, confirm_top=2,
                                  name=name, resume=args.resume)
                runner = StudyRunner(db, fleet, cfg, target, alive_nodes=fleet.alive_nodes, stop=stop)
                runner.prepare()
                runners.append(runner)
            outcomes = run_studies(runners, stop)
        except BadInput as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except StudyPaused as exc:
            print(f"paused: {exc}", file=sys.stderr)
            return EXIT_PAUSED
    print(json.dumps([o.name for o in outcomes]))
    return EXIT_OK


# ---------------------------------------------------------------- a private PostgreSQL server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).is_file():
            return str(folder / name)
    raise FileNotFoundError(f"{name} (PostgreSQL's server binaries) not found")


class PrivatePostgres:
    """A PostgreSQL server of our own in a temporary directory, on a free port, trust auth.

    As root, the server runs as the ``postgres`` user (``initdb`` refuses root)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fleettune-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, *argv: str) -> None:
        subprocess.run([*self._as, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       cwd=self.dir)

    def start(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                  "-l", str(self.dir / "log"), "restart")

    def new_database(self) -> str:
        from sqlalchemy import create_engine, text

        name = f"faults_{uuid.uuid4().hex[:8]}"
        engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres",
                               isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- the harness


@dataclass
class Tally:
    """Faults injected and what the audits found, per kind."""

    faults: Counter = field(default_factory=Counter)
    studies: Counter = field(default_factory=Counter)
    held: Counter = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)
    phases: Counter = field(default_factory=Counter)
    pause_s: list[float] = field(default_factory=list)
    paused: int = 0  # signals that paused a study (the rest came after it had ended)
    harness_errors: list[str] = field(default_factory=list)  # a fault group that could not run
    node_lost_trials: int = 0  # trials failed "node lost" by the node removals
    node_pauses: int = 0  # studies paused with no node of their chip left

    def add(self, other: Tally) -> None:
        self.faults += other.faults
        self.studies += other.studies
        self.held += other.held
        self.lost += other.lost
        self.duplicated += other.duplicated
        self.problems += other.problems
        self.phases += other.phases
        self.pause_s += other.pause_s
        self.paused += other.paused
        self.node_lost_trials += other.node_lost_trials
        self.node_pauses += other.node_pauses


class Harness:
    """Starts drivers against one database and injects faults into them."""

    def __init__(self, url: str, *, trials: int = 24, nodes: int = 4, trial_s: float = 0.05,
                 seed: int = 0, env: dict | None = None, chips: int = 1) -> None:
        self.url, self.trials, self.nodes, self.trial_s, self.chips = url, trials, nodes, trial_s, chips
        self.rng = random.Random(seed)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.tally = Tally()
        self.on_audit: Callable[[], None] = lambda: None  # e.g. write the report so far

    def start(self, study: str | None, *, resume: bool = False, chips: int | None = None,
              extra_env: dict | None = None, trial_s: float | None = None) -> subprocess.Popen:
        argv = [sys.executable, str(ROOT / "bench" / "faults.py"), "drive", "--db", self.url,
                "--trials", str(self.trials), "--nodes", str(self.nodes),
                "--trial-s", str(trial_s or self.trial_s),
                "--chips", str(chips or self.chips), "--seed", str(self.rng.randrange(1 << 30))]
        if study:
            argv += ["--study", study]
        if resume:
            argv.append("--resume")
        return subprocess.Popen(argv, env={**self.env, **(extra_env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(self, proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
        """The driver's exit code and its last line (stderr; stdout when it succeeded)."""
        out, err = proc.communicate(timeout=timeout)
        text = out if proc.returncode == EXIT_OK else err
        # a traceback's last line is SQLAlchemy's "(Background on this error at: ...)": the one above says it
        lines = [line for line in text.strip().splitlines() if not line.startswith("(Background on this error")]
        return proc.returncode, (lines or [""])[-1][:300]

    def _rows(self, sql: str, study: str) -> list:
        """Rows of a query about the study (and its per-chip siblings); none before the schema."""
        from sqlalchemy import create_engine, text

        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                return list(conn.execute(text(sql), {"n": study + "%"}))
        except Exception:  # noqa: BLE001 - the schema may not exist yet
            return []
        finally:
            engine.dispose()

    def newest_row(self, study: str) -> tuple[int, str]:
        """The id and phase of the study's newest trial row ((0, "setup") before the first)."""
        rows = self._rows("select t.id, t.phase from ft_trials t join ft_studies s on s.id = t.study_id "
                          "where s.name like :n order by t.id desc limit 1", study)
        return (rows[0][0], rows[0][1]) if rows else (0, "setup")

    def phase_now(self, study: str) -> str:
        """The phase the study's newest trial row is in (what a fault at this instant interrupts)."""
        return self.newest_row(study)[1]

    def exists(self, study: str) -> bool:
        return bool(self._rows("select id from ft_studies where name like :n", study))

    def all_complete(self, study: str, chips: int | None = None) -> bool:
        states = [r[0] for r in self._rows("select state from ft_studies where name like :n", study)]
        return len(states) == (chips or self.chips) and set(states) == {"complete"}

    def settle(self, proc: subprocess.Popen, study: str, kind: str) -> int:
        """After a database fault: the driver went on (0) or paused (3, then resumed); audited."""
        code, line = self.finish(proc)
        if code not in (EXIT_OK, EXIT_PAUSED):
            self.tally.problems.append(f"{kind} {study}: exit {code}: {line}")
        if code == EXIT_PAUSED:
            self.resume_to_end(study)
        self.audit([study], kind)
        return code

    def resume_to_end(self, study: str, chips: int | None = None, attempts: int = 5) -> int:
        """Resume the study until it completes (start it, if a fault came before it existed)."""
        for _ in range(attempts):
            code, line = self.finish(self.start(study, resume=self.exists(study), chips=chips))
            if code == EXIT_OK:
                return code
            if code != EXIT_PAUSED:
                raise RuntimeError(f"resume of {study} exited {code}: {line}")
        raise RuntimeError(f"{study} not complete after {attempts} resumes")

    def audit(self, names: list[str], kind: str) -> None:
        from orchestrator.audit import audit_study
        from orchestrator.db import open_database

        db = open_database(self.url)
        try:
            for name in names:
                report = audit_study(db, name)
                self.tally.studies[kind] += 1
                self.tally.lost += report.lost
                self.tally.duplicated += report.duplicated
                if report.ok and report.state == "complete":
                    self.tally.held[kind] += 1
                else:
                    self.tally.problems += [f"{kind} {name}: {p}" for p in report.problems or [report.state]]
        finally:
            db.dispose()
        self.on_audit()

    def names(self, study: str, chips: int | None = None) -> list[str]:
        n = chips or self.chips
        return [f"{study}-{i}" for i in range(n)] if n > 1 else [study]

    # -- the faults

    PHASES = ("setup", "baseline", "search", "confirm")

    def kills(self, count: int, per_study: int = 3) -> None:
        """SIGKILL of the driver at instants spread over every phase (while it starts, measures the
        baseline, searches, confirms), a few per study, then --resume to the end."""
        done = 0
        while done < count:
            study = f"kill-{uuid.uuid4().hex[:6]}"
            for _ in range(min(per_study, count - done)):
                target = self.rng.choice(("setup", "baseline", "search", "search", "search", "confirm"))
                start_id, _ = self.newest_row(study)
                proc = self.start(study, resume=self.exists(study))
                if target == "setup":
                    deadline = time.monotonic() + self.rng.uniform(0.3, 3.0)
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.01)  # a random instant to kill at, not a synchronisation
                else:  # once this driver has written a row of the target phase (or a later one)
                    while proc.poll() is None:
                        row_id, phase = self.newest_row(study)
                        if row_id > start_id and self.PHASES.index(phase) >= self.PHASES.index(target):
                            break
                        time.sleep(0.01)  # polling the database for the phase
                    # a random instant inside the phase; the baselines are one short round, so
                    # a kill aimed at them lands as soon as their rows are seen
                    deadline = time.monotonic() + (0.0 if target == "baseline" else self.rng.uniform(0.0, 0.2))
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.005)
                if proc.poll() is not None:  # finished before the instant: no fault injected
                    self.finish(proc)
                    continue
                row_id, phase = self.newest_row(study)
                self.tally.phases[phase if row_id > start_id else "setup"] += 1
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self.tally.faults["SIGKILL driver"] += 1
                done += 1
            self.resume_to_end(study)
            self.audit(self.names(study), "SIGKILL driver")

    def signals(self, count: int, chips: int = 1) -> None:
        """SIGINT/SIGTERM/SIGHUP at a random instant: the driver pauses within seconds (exit 3)."""
        for i in range(count):
            sig = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)[i % 3]
            study = f"sig-{uuid.uuid4().hex[:6]}"
            proc = self.start(study, chips=chips, trial_s=max(self.trial_s, 0.2))
            while proc.poll() is None and self.phase_now(study) == "setup":
                time.sleep(0.02)  # polling for the study to exist: its signal handlers are in place
            deadline = time.monotonic() + self.rng.uniform(0.0, 1.0)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)  # a random instant to signal at, not a synchronisation
            if proc.poll() is None:
                sent = time.monotonic()
                proc.send_signal(sig)
                code, line = self.finish(proc, timeout=60)
                self.tally.pause_s.append(time.monotonic() - sent)
                self.tally.paused += code == EXIT_PAUSED
                kind = f"{sig.name}{' --all-chips' if chips > 1 else ''}"
                # the signal's own exit is right only when it came after the studies had ended
                if code not in (EXIT_OK, EXIT_PAUSED) and not (code == -sig and self.all_complete(study, chips)):
                    self.tally.problems.append(f"{kind} {study}: exit {code}: {line}")
                self.tally.faults[kind] += 1
            else:
                kind = "no fault (finished first)"
                self.finish(proc)
            self.resume_to_end(study, chips=chips)
            self.audit(self.names(study, chips), kind)

    def two_drivers(self, count: int) -> None:
        """A second driver on a running study is refused (exit 2); the first completes."""
        for _ in range(count):
            study = f"two-{uuid.uuid4().hex[:6]}"
            first = self.start(study)
            while first.poll() is None and self.phase_now(study) == "setup":
                time.sleep(0.02)  # polling for the first driver's rows
            second = self.start(study, resume=True)
            code, line = self.finish(second)
            self.tally.faults["two drivers on one study"] += 1
            first_code, first_line = self.finish(first)
            # refused while the first holds the study; 0 only if it came after the first had ended
            if code not in (EXIT_BAD_INPUT, EXIT_OK) or (code == EXIT_BAD_INPUT and "another driver" not in line):
                self.tally.problems.append(f"second driver exit {code}: {line}")
            if first_code != EXIT_OK:
                self.tally.problems.append(f"first driver exit {first_code}: {first_line}")
            self.audit([study], "two drivers on one study")

    def same_name(self, count: int) -> None:
        """Two new studies with the same default name at once: both run, under distinct names."""
        for _ in range(count):
            before = {r[0] for r in self._rows("select name from ft_studies where name like :n", "")}
            procs = [self.start(None) for _ in range(2)]
            names = []
            for proc in procs:
                code, line = self.finish(proc)
                if code != EXIT_OK:
                    self.tally.problems.append(f"same-name driver exit {code}: {line}")
                else:
                    names += json.loads(line)
            self.tally.faults["two new studies, one name"] += 1
            if len(set(names)) != len(names):
                self.tally.problems.append(f"two new studies share a name: {names}")
            # every study the two created, a crashed driver's too (it is left running: not held)
            created = {r[0] for r in self._rows("select name from ft_studies where name like :n", "")} - before
            self.audit(sorted(created | set(names)), "two new studies, one name")


def sqlite_lock(h: Harness, hold_s: float, kind: str) -> int:
    """Another process holds the SQLite file's write lock for ``hold_s`` seconds mid-study."""
    path = h.url.removeprefix("sqlite:///")
    study = f"lock-{uuid.uuid4().hex[:6]}"
    proc = h.start(study)
    while proc.poll() is None and h.phase_now(study) != "search":
        time.sleep(0.02)  # polling for the search to start
    locker = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"c = sqlite3.connect({path!r}, timeout=30, isolation_level=None)\n"
        "c.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        f"time.sleep({hold_s})  # the lock held: the fault itself\n"
        "c.execute('COMMIT')\n")], stdout=subprocess.PIPE, text=True)
    locker.stdout.readline()
    h.tally.faults[kind] += 1
    locker.wait()
    return h.settle(proc, study, kind)


def pg_restart(h: Harness, server: PrivatePostgres, *, down_s: float, kind: str) -> int:
    """The database server stops mid-study for ``down_s`` seconds (0: a plain restart)."""
    study = f"pg-{uuid.uuid4().hex[:6]}"
    proc = h.start(study)
    while proc.poll() is None and h.phase_now(study) != "search":
        time.sleep(0.02)  # polling for the search to start
    if down_s:
        server.stop()
        deadline = time.monotonic() + down_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the outage itself
        server.start()
    else:
        server.restart()
    h.tally.faults[kind] += 1
    return h.settle(proc, study, kind)


def node_losses(h: Harness, count: int, per_round: int = 3) -> None:
    """Nodes of a real Ray cluster removed mid-trial, one after another until none of the chip is
    left: each loss fails its trial "node lost" and it runs again elsewhere; with no node left the
    study pauses; new nodes join and ``--resume`` completes it."""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from orchestrator import dispatch
    from orchestrator.db import open_database
    from orchestrator.fleet import node_states
    from orchestrator.studies import ChipTarget, StudyConfig, StudyPaused, StudyRunner
    from workers import simulated
    from workers.join import plan_join
    from workers.trial import Workload

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": {
        "health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_initial_delay_ms": 0}})
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    plan = plan_join("M1 Pro/16", "calibrated", time_scale=0.05)
    db = open_database(h.url)
    removed = 0
    try:
        while removed < count:
            study = f"nodes-{uuid.uuid4().hex[:6]}"
            for attempt in range(2):  # the fault round, then the resume on fresh nodes
                nodes = [cluster.add_node(num_cpus=0, resources=plan.resources, labels=plan.labels)
                         for _ in range(per_round)]
                cluster.wait_for_nodes()
                cfg = StudyConfig(model=simulated.sim_model_info(MODEL), workload=Workload(512, 128, 1),
                                  n_trials=h.trials, sampler="tpe", seed=h.rng.randrange(1000), confirm_top=2,
                                  name=study, resume=attempt > 0)
                runner = StudyRunner(db, dispatch.RayDispatcher(nodes_ttl_s=0), cfg,
                                     ChipTarget(plan.fingerprint, {}, True))
                runner.no_node_grace_s = 3.0
                runner.prepare()
                outcome: dict = {}

                def run(r=runner, out=outcome) -> None:
                    try:
                        out["done"] = r.run()
                    except StudyPaused as exc:
                        out["paused"] = exc

                thread = threading.Thread(target=run)
                thread.start()
                if attempt == 0:
                    for node in nodes:  # each removed while the study runs on it
                        time.sleep(h.rng.uniform(0.3, 1.2))  # a random instant, not a synchronisation
                        busy_by = time.monotonic() + 3.0  # then, if it can be had, while it runs a trial
                        while thread.is_alive() and time.monotonic() < busy_by and \
                                node_states().get(node.node_id, ("",))[0] != "busy":
                            time.sleep(0.02)  # polling Ray's view of the node's bench slot
                        cluster.remove_node(node, allow_graceful=False)
                        removed += 1
                        h.tally.faults["Ray node removed mid-study"] += 1
                thread.join(timeout=300)
                h.tally.node_pauses += "paused" in outcome
                if attempt == 1:
                    for node in nodes:
                        cluster.remove_node(node)
                if "done" in outcome:
                    break
            h.audit([study], "Ray node removed mid-study")
            h.tally.node_lost_trials += len(h._rows(
                "select t.id from ft_trials t join ft_studies s on s.id = t.study_id "
                "where s.name like :n and t.failure_kind = 'node lost'", study))
    finally:
        db.dispose()
        ray.shutdown()
        cluster.shutdown()


def run(args) -> Tally:
    tmp = Path(tempfile.mkdtemp(prefix="fleettune-faults-"))
    server = None
    env = {"FLEETTUNE_DB_RETRY_S": str(args.retry_s), "FLEETTUNE_SQLITE_BUSY_TIMEOUT_S": "1"}
    try:
        if args.db == "sqlite":
            url = f"sqlite:///{tmp / 'faults.db'}"
        else:
            server = PrivatePostgres()
            server.start()
            url = server.new_database()
        from orchestrator.db import open_database

        open_database(url).dispose()  # the schema, before drivers race to create it
        h = Harness(url, seed=args.seed, env=env, trials=args.trials)
        if args.progress:  # after every audited study too, so a run cut mid-group still reports
            h.on_audit = lambda: Path(args.progress).write_text(report(h.tally, args.db))

        def db_faults() -> None:
            for i in range(args.db_faults):
                if args.db == "sqlite":
                    long_lock = i % 2 == 1
                    sqlite_lock(h, args.retry_s + 2 if long_lock else 2.0, "SQLite locked past the retry window"
                                if long_lock else "SQLite locked past busy timeout")
                else:
                    long_outage = i % 2 == 1
                    pg_restart(h, server, down_s=args.retry_s + 3 if long_outage else 0,
                               kind="PostgreSQL stopped past the retry window" if long_outage
                               else "PostgreSQL restart")

        groups = [lambda: h.kills(args.kills), lambda: h.signals(args.signals),
                  lambda: h.signals(-(-args.signals // 3), chips=3),  # a third, none when 0
                  lambda: h.two_drivers(args.races), lambda: h.same_name(args.races), db_faults]
        if args.node_losses:
            groups.append(lambda: node_losses(h, args.node_losses))
        for group in groups:
            try:
                group()
            except Exception as exc:  # noqa: BLE001 - the harness's own failure, reported, not hidden
                h.tally.harness_errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            if args.progress:  # what is known so far, in case a later group cannot finish
                Path(args.progress).write_text(report(h.tally, args.db))
        return h.tally
    finally:
        if server:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def report(tally: Tally, backend: str) -> str:
    lines = ["| fault | backend | injected | studies audited | invariants held |",
             "| --- | --- | ---: | ---: | ---: |"]
    for kind in sorted(set(tally.faults) | set(tally.studies)):
        lines.append(f"| {kind} | {backend} | {tally.faults[kind]} | {tally.studies[kind]} | "
                     f"{tally.held[kind]}/{tally.studies[kind]} |")
    total = sum(tally.faults.values())
    lines.append(f"\n{total} faults of {len(tally.faults)} kinds; results lost {tally.lost}, duplicated "
                 f"{tally.duplicated}; kill instants by phase: {dict(tally.phases)}")
    if tally.pause_s:
        ordered = sorted(tally.pause_s)
        lines.append(f"signals: {tally.paused} of {len(ordered)} paused a running study (the rest came as it "
                     f"ended); signal to exit: median {ordered[len(ordered) // 2]:.2f} s, max {ordered[-1]:.2f} s")
    if tally.faults["Ray node removed mid-study"]:
        lines.append(f"node removals: {tally.node_lost_trials} trials failed \"node lost\" and ran again; "
                     f"{tally.node_pauses} studies paused with no node left, then resumed on new nodes")
    for problem in tally.problems:
        lines.append(f"PROBLEM: {problem}")
    for error in tally.harness_errors:
        lines.append(f"harness error (a fault group did not complete; not an invariant): {error}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive", help="run or resume a study (the process faults are injected into)")
    d.add_argument("--db", required=True)
    d.add_argument("--study")
    d.add_argument("--resume", action="store_true")
    d.add_argument("--trials", type=int, default=24)
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--trial-s", type=float, default=0.05)
    d.add_argument("--chips", type=int, default=1)
    d.add_argument("--sampler", default="tpe")
    d.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="inject faults and audit")
    r.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    r.add_argument("--kills", type=int, default=30)
    r.add_argument("--signals", type=int, default=9)
    r.add_argument("--races", type=int, default=3)
    r.add_argument("--db-faults", type=int, default=4)
    r.add_argument("--node-losses", type=int, default=6, help="Ray nodes removed mid-study (a real cluster)")
    r.add_argument("--trials", type=int, default=24)
    r.add_argument("--retry-s", type=float, default=4.0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--progress", help="file the report so far is written to after each group of faults")
    args = parser.parse_args()
    if args.cmd == "drive":
        return drive(args)
    started = time.monotonic()
    tally = run(args)
    print(report(tally, args.db))
    print(f"({time.monotonic() - started:.0f} s; python bench/faults.py run --db {args.db} --kills {args.kills} "
          f"--signals {args.signals} --races {args.races} --db-faults {args.db_faults} "
          f"--node-losses {args.node_losses})")
    return 1 if tally.problems or tally.lost or tally.duplicated else 0


if __name__ == "__main__":
    sys.exit(main())
