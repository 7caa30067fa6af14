"""The fleet across real hosts: a head and three workers, each in its own network namespace on a
bridged LAN (198.51.100.0/24), each with its own raylet started by fleettune's own commands, plus
an intruder host that holds no token. Real llama.cpp on one worker, simulated Macs on the others.

What is checked: which addresses the head listens on (``ss`` inside its namespace); that every
port it listens on refuses a client without the token and with a wrong one (and serves the right
one); that the token never shows on a command line or in `head start`'s output; a real
`tune --all-chips`; a worker's cable pulled mid-trial and plugged back; the head's host lost and
the study resumed on a new head.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import sys
import tempfile
from pathlib import Path

import pytest

from tests.netns import HEAD_ADDR, Lan, netns_available, wait_for

WHY_NOT = netns_available()
pytestmark = [pytest.mark.cluster, pytest.mark.netns,
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
REPO = Path(__file__).resolve().parents[1]
SIM_CHIP = "M2 Ultra/76"
SIM_KEY = "apple-m2-ultra-76g"
SIM_MODEL = "sim://llama2-7b/q4_0"
SIM_TIME_SCALE = "0.3"  # a simulated trial takes about 0.5-3 s: long enough to be caught mid-way
SLOW_TRIAL_S = "20"  # w3's every trial: long enough that a cable pulled once it is seen running cuts it
PORT = 6379
ADDRESS = f"{HEAD_ADDR}:{PORT}"
# The head's GCS declares a silent node dead after ~8-13 s (Ray's default: 3 s period, 10 s
# timeout, 5 failures); tighter timeouts (1 s) declared busy raylets dead on a loaded 2-core machine. A worker's raylet notices a silent head by gRPC keepalive (2 s, Ray's default
# 5 min) and gives up on it 10 s later (Ray's default: 60 s).
HEAD_RAY_ENV = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "5000",
                "RAY_health_check_failure_threshold": "4"}
KEEPALIVE_ENV = {"RAY_grpc_client_keepalive_time_ms": "2000", "RAY_grpc_client_keepalive_timeout_ms": "2000"}
WORKER_RAY_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "10", **KEEPALIVE_ENV}
# Where Ray 2.60 binds every interface of a node whose address is not loopback, whatever fleettune
# asks of it: the process behind such a listener (from its /proc cmdline), and why (Ray's source).
# fleettune closes the rest: `ray start --no-monitor` (the autoscaler's Prometheus endpoint) and
# RAY_enable_metrics_collection=0 (the dashboard agent's); docs/security.md says what protects these.
RAY_WILDCARD = {
    "gcs": "the GCS (--port): src/ray/rpc/grpc_server.cc binds 0.0.0.0 unless the node is "
           "127.0.0.1 (listen_to_localhost_only); Ray has no option naming the address",
    "raylet": "the raylet's node manager and object manager: the same GrpcServer::Run",
    "core worker": "the gRPC server of every driver and Ray worker (CoreWorker): the same GrpcServer::Run",
    "dashboard agent": "the dashboard agent's gRPC server (ray[default]): dashboard/agent.py binds "
                       "get_all_interfaces_ip() unless the node is on loopback",
}
TUNE = ["--prompt-tokens", "64", "--gen-tokens", "16", "-r", "1", "--quiet", "--no-warm-start",
        "--confirm-top", "0", "--address", ADDRESS]


def fleettune(host, *args, env=None, timeout=240):
    if env is None and host.name == "head":  # the head's own commands find its token file by env
        env = head_env(host)
    done = host.run(FLEETTUNE, *map(str, args), env=env, timeout=timeout)
    assert done.returncode == 0, f"fleettune {' '.join(map(str, args))} on {host.name}: " \
        f"{(done.stderr or done.stdout)[-3000:]}"
    return done.stdout


def head_env(head) -> dict:
    """The environment of a command run on the head's host: its token file named by env, and
    gRPC keepalive so that a driver notices a worker gone silent mid-trial (Ray's default: 5 min)."""
    return head.env(FLEETTUNE_RAY_TOKEN_FILE=str(head.root / "secret" / "ray_token"), **KEEPALIVE_ENV)


def ray_processes(host) -> dict[int, str]:
    """pid -> command line of every process running on ``host``."""
    out = {}
    for pid in host.pids():
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def dashboard_available() -> bool:
    """Ray's dashboard (and its job API) needs `ray[default]`; the namespaced head starts it when
    installed, so its ports are bound and probed like the others."""
    from ray._private.utils import get_dashboard_dependency_error

    return get_dashboard_dependency_error() is None


def component(pid: int | None) -> str:
    """Which Ray (or fleettune) process ``pid`` is, from its command line (Ray retitles its own)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, TypeError):
        return "gone"
    for needle, name in (("gcs_server", "gcs"), ("raylet/raylet", "raylet"), ("DashboardAgent", "dashboard agent"),
                         ("dashboard/agent.py", "dashboard agent"), ("dashboard/dashboard.py", "dashboard"),
                         ("RuntimeEnvAgent", "runtime env agent"), ("runtime_env/agent", "runtime env agent"), ("client.server", "ray client server"),
                         ("default_worker", "core worker"), ("ray::", "core worker"), ("fleettune", "core worker")):
        if needle in cmd:
            return name
    return cmd[:80]


def wildcard(addr: str) -> bool:
    return addr in ("*", "0.0.0.0", "::", "[::]")


def measuring(host) -> list[str]:
    """Processes of ``host`` that are measuring a trial right now: a Ray worker titled with the
    trial's task name (dispatch names it "fleettune-trial KEY"), or llama.cpp's measuring child."""
    return [cmd for cmd in ray_processes(host).values()
            if "fleettune-trial" in cmd or "run_trial" in cmd or "workers.bench" in cmd]


def trials_in_flight(host) -> set[tuple[int, str]]:
    """(pid, command line) of the processes measuring on ``host`` now: a process keeps its title
    while Ray cancels it, so a trial of an earlier study can still show for a moment."""
    return {(pid, cmd) for pid, cmd in ray_processes(host).items()
            if "fleettune-trial" in cmd or "run_trial" in cmd or "workers.bench" in cmd}


def a_new_trial_on(host, before: set) -> set:
    """Wait until ``host`` measures something it did not when ``before`` was taken: a trial of
    the study just started, not one of an earlier study still being cancelled."""
    return wait_for(lambda: trials_in_flight(host) - before, 180, f"a new trial running on {host.name}")


def join(host, token_file: Path, *extra, env_token: str | None = None):
    """`fleettune worker start` on ``host``: token from a file, or from the environment."""
    env = host.env(**WORKER_RAY_ENV, **({"FLEETTUNE_RAY_TOKEN": env_token} if env_token else {}))
    args = ["worker", "start", "--address", ADDRESS, "--name", host.name, *extra]
    if not env_token:
        args += ["--token-file", token_file]
    return fleettune(host, *args, env=env)


def give_token(host, head_token_file: Path) -> Path:
    """Copy the head's token file to ``host`` the way a user would (scp, then 0600)."""
    dest = host.root / "ray_token"
    shutil.copyfile(head_token_file, dest)
    os.chmod(dest, 0o600)
    return dest


def start_head(lan) -> tuple[str, Path]:
    head = lan.head
    token_file = head.root / "secret" / "ray_token"
    out = fleettune(head, "head", "start", "--host", HEAD_ADDR, "--port", PORT, "--token-file", token_file,
                    "--db", f"sqlite:///{head.root / 'results.db'}",
                    *(["--dashboard"] if dashboard_available() else []), env=head.env(**HEAD_RAY_ENV))
    return out, token_file


def trials(db_path: Path, study: str | None = None, phase: str = "search") -> list[tuple]:
    """(host, state, error, params) of every trial of ``phase`` (any phase: ``"%"``), the host by
    its `worker start --name` (None for a trial whose node was lost: no result came back to say
    where it ran)."""
    query = ("select n.hostname, t.state, t.error, t.params || ' ' || t.phase from ft_trials t "
             "left join ft_nodes n on n.id = t.node_id join ft_studies s on s.id = t.study_id "
             "where t.phase like ?" + (" and s.name = ?" if study else ""))
    with sqlite3.connect(db_path) as conn:
        return conn.execute(query, (phase, study) if study else (phase,)).fetchall()


@pytest.fixture(scope="module")
def lan():
    root = Path(tempfile.mkdtemp(prefix="ftn", dir="/tmp"))  # short: Ray's socket paths live below
    net = Lan(root, workers=3, extra={"x": 66})
    try:
        yield net
    finally:
        net.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(lan, model_path):
    """Head on 198.51.100.1; w1 real (this machine's chip, token from the environment), w2 and w3
    simulated M2 Ultras (token from a copied file), all started by the printed join line."""
    out, token_file = start_head(lan)
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("fleettune worker start"))
    argv = shlex.split(line)
    assert argv[argv.index("--address") + 1] == ADDRESS
    token = token_file.read_text().strip()
    w1, w2, w3 = lan.workers
    join(w1, token_file, env_token=token)
    join(w2, give_token(w2, token_file), "--simulate", SIM_CHIP, "--time-scale", SIM_TIME_SCALE)
    # w3's trials take 20 s, so a cable pulled once one is seen running cuts it, whatever the load
    join(w3, give_token(w3, token_file), "--simulate", SIM_CHIP, "--trial-seconds", SLOW_TRIAL_S)
    return {"head_output": out, "token_file": token_file, "token": token, "join_line": argv}


# ---------------------------------------------------------------- binding


@pytest.fixture(scope="module")
def busy_head(fleet, lan):
    """The head seen once while a study measures on the simulated Macs (so it also has a driver
    and its Ray workers listening): its listeners (ss) and what the intruder's knocks on each of
    those ports got (tests/netns_probe.py); the study is then paused (SIGTERM)."""
    head, intruder = lan.head, lan.hosts["x"]
    db = head.root / "busy.db"
    driver = head.spawn(FLEETTUNE, "tune", SIM_MODEL, "--chip", SIM_KEY, "--db", f"sqlite:///{db}",
                        "--study", "busy", *TUNE, "--trials", "200", log=head.root / "busy.log",
                        env=head_env(head))
    try:
        wait_for(lambda: any(measuring(w) for w in lan.workers[1:]), 120, "a trial running on a simulated Mac")
        listeners = head_listeners(lan)
        ports = sorted({port for addr, port, _ in listeners if not addr.endswith("127.0.0.1")})
        token_file = give_token(intruder, fleet["token_file"])  # for the control only
        done = intruder.run(sys.executable, "-m", "tests.netns_probe", HEAD_ADDR, *map(str, ports),
                            "--token-file", str(token_file), env=intruder.env(PYTHONPATH=str(REPO)),
                            timeout=300)
        token_file.unlink()
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=60)
        except Exception:
            driver.kill()
            driver.wait(timeout=30)
        # the paused study's trials are cancelled: its bench slots free again for the next test
        wait_for(lambda: not any(measuring(w) for w in lan.workers), 60, "the paused study's trials ending")
    return {"listeners": listeners, "ports": ports, "probe": json.loads(done.stdout)}


def test_a_loopback_head_listens_on_loopback_only(tmp_path):
    """`head start` (default --host 127.0.0.1) in a host of its own: every listener is loopback
    (the dashboard's too, where `ray[default]` is installed)."""
    root = Path(tempfile.mkdtemp(prefix="ftn", dir="/tmp"))
    solo = Lan(root, workers=0)
    try:
        head = solo.head
        fleettune(head, "head", "start", "--db", f"sqlite:///{root / 'r.db'}",
                  *(["--dashboard"] if dashboard_available() else []))
        listeners = wait_for(lambda: len(head.listeners()) >= 4 and head.listeners(), 30, "Ray's listeners")
        assert any(port == PORT for _, port, _ in listeners)
        outside = [entry for entry in listeners if not entry[0].endswith("127.0.0.1")]
        assert outside == [], f"listeners beyond loopback: {outside}"
    finally:
        solo.close()
        shutil.rmtree(root, ignore_errors=True)


def head_listeners(lan) -> list[tuple[str, int, str]]:
    """(address, port, component) of every listener of the head's host."""
    out = []
    for addr, port, procs in lan.head.listeners():
        pid = re.search(r"pid=(\d+)", procs)
        out.append((addr, port, component(int(pid.group(1)) if pid else None)))
    return out


def test_a_lan_heads_listeners_are_on_its_address_but_for_rays_known_wildcards(busy_head):
    """With --host 198.51.100.1 (and a driver connected), a listener on any other address is one
    of RAY_WILDCARD (each tested below), bound to the wildcard: no third address, nothing of
    fleettune's, no Ray process not known to do this."""
    listeners = busy_head["listeners"]
    assert PORT in {port for _, port, _ in listeners}
    elsewhere = [entry for entry in listeners if not entry[0].endswith((HEAD_ADDR, "127.0.0.1"))]
    assert all(wildcard(addr) for addr, _, _ in elsewhere), elsewhere
    assert [e for e in elsewhere if e[2] not in RAY_WILDCARD] == []


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=why))
    for name, why in RAY_WILDCARD.items()])
def test_a_lan_head_binds_each_ray_server_to_its_address_only(name, busy_head):
    """What issue 14 asks of every listener; Ray 2.60 cannot do it for these (xfail, strict: a
    Ray that binds them to the node's address passes, and RAY_WILDCARD and docs/security.md must
    change)."""
    mine = [entry for entry in busy_head["listeners"] if entry[2] == name]
    if not mine:
        pytest.skip(f"no {name} listening on this head (the dashboard needs `ray[default]`)")
    assert [entry for entry in mine if wildcard(entry[0])] == []


# ---------------------------------------------------------------- authentication


def test_every_port_of_the_head_refuses_a_missing_or_wrong_token(busy_head):
    """From the intruder's host, each port the head listens on (per ss, with a driver connected,
    and the dashboard and job API where `ray[default]` is installed) is knocked on without a token
    and with a wrong one: refused by the server itself; the right token is served. No exception:
    the dashboard's own Prometheus endpoint, which answered anyone, is not started (join.py)."""
    ports, results = busy_head["ports"], busy_head["probe"]
    refused = {"UNAUTHENTICATED", "401", "403"}
    assert [r["port"] for r in results] == ports
    for r in results:
        assert r["service"] not in ("unknown", "unreachable"), r
        assert r["none"] in refused and r["wrong"] in refused, r
        assert r["right"] not in refused | {"UNIMPLEMENTED", "UNAVAILABLE"}, r
    services = {r["service"] for r in results}
    assert {"grpc /ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "grpc /ray.rpc.CoreWorkerService/NumPendingTasks",
            "grpc /ray.rpc.RayletDriver/ClusterInfo"} <= services, services
    if dashboard_available():  # the dashboard's job API and the dashboard agent, knocked on too
        assert {"http GET /api/jobs/", "grpc /ray.rpc.ReporterService/HealthCheck"} <= services, services


def test_a_worker_or_client_with_a_wrong_token_cannot_join(fleet, lan):
    intruder = lan.hosts["x"]
    wrong = intruder.root / "wrong_token"
    wrong.write_text("0" * len(fleet["token"]))
    done = intruder.run(FLEETTUNE, "worker", "start", "--address", ADDRESS, "--simulate", SIM_CHIP,
                        "--token-file", str(wrong), env=intruder.env(**WORKER_RAY_ENV), timeout=240)
    assert done.returncode != 0
    assert not any("raylet" in cmd for cmd in ray_processes(intruder).values())
    code = f"import ray; ray.init(address={ADDRESS!r}); print('joined')"
    for env in ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, {}):
        client = intruder.run(sys.executable, "-c", code, env=intruder.env(**env), timeout=240)
        assert client.returncode != 0 and "joined" not in client.stdout


def test_the_token_is_never_on_a_command_line_nor_printed(fleet, lan):
    token = fleet["token"]
    assert token not in fleet["head_output"]
    assert "--token " not in fleet["head_output"] and "--token-file" in fleet["head_output"]
    for host in lan.hosts.values():  # every process of the fleet, on every host
        leaks = [cmd for cmd in ray_processes(host).values() if token in cmd]
        assert leaks == [], f"token in argv on {host.name}: {leaks}"
    shown = fleettune(lan.head, "head", "token", "--token-file", fleet["token_file"])
    assert shown.strip() == token
    assert (os.stat(fleet["token_file"]).st_mode & 0o777) == 0o600


def test_a_failed_head_start_keeps_the_previous_token(tmp_path):
    """Ray's GCS binds every interface: a port taken on loopback makes `ray start` fail on the
    LAN address. The saved token must still be the old one (workers still hold it)."""
    root = Path(tempfile.mkdtemp(prefix="ftn", dir="/tmp"))
    solo = Lan(root, workers=0)
    try:
        head = solo.head
        token_file = root / "ray_token"
        token_file.write_text("previous-token")
        os.chmod(token_file, 0o644)  # as left by an older fleettune, or a careless copy
        squat = head.spawn(sys.executable, "-c", "import socket,time; s=socket.socket(); "
                           f"s.bind(('127.0.0.1', {PORT})); s.listen(); time.sleep(300)")
        wait_for(lambda: any(p == PORT for _, p, _ in head.listeners()), 30, "the squatter")
        done = head.run(FLEETTUNE, "head", "start", "--host", HEAD_ADDR, "--token-file", str(token_file),
                        "--db", f"sqlite:///{root / 'r.db'}", env=head.env(**HEAD_RAY_ENV))
        squat.kill()
        squat.wait(timeout=30)
        assert done.returncode != 0
        assert done.stderr.count("\n") <= 1 and done.stderr.startswith("error:"), done.stderr
        assert token_file.read_text() == "previous-token"
        # started for real: the token is replaced, the file now 0600
        fleettune(head, "head", "start", "--host", HEAD_ADDR, "--token-file", token_file,
                  "--db", f"sqlite:///{root / 'r.db'}", env=head.env(**HEAD_RAY_ENV))
        assert token_file.read_text() != "previous-token"
        assert (os.stat(token_file).st_mode & 0o777) == 0o600
    finally:
        solo.close()
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- partitions


def test_a_worker_cut_off_mid_trial_is_measured_elsewhere_then_rejoins(fleet, lan):
    """w3's cable is pulled once a trial is seen running there (its Ray worker titled with the
    trial; each of w3's trials takes 20 s): that trial fails "node lost" and is measured again on
    w2, the study completes; plugged back and restarted, w3 takes trials again."""
    head, w3 = lan.head, lan.hosts["w3"]
    db = head.root / "part.db"
    study = ["tune", SIM_MODEL, "--chip", SIM_KEY, "--db", f"sqlite:///{db}", "--study", "part", *TUNE]
    before = trials_in_flight(w3)
    driver = head.spawn(FLEETTUNE, *study, "--trials", "8", "--seed", "1", log=head.root / "part.log",
                        env=head_env(head))
    try:
        a_new_trial_on(w3, before)
        w3.link(False)  # the cable pulled, mid-trial (it has 20 s to go at most)
        assert driver.wait(timeout=300) == 0, (head.root / "part.log").read_text()[-3000:]
    finally:
        w3.link(True)
        if driver.poll() is None:
            driver.kill()
    rows = trials(db, "part", phase="%")  # the cut trial may be the baseline (w3's first trial)
    lost = [r for r in rows if r[2] == "node lost"]
    assert len(lost) == 1, [(r[0], r[1], r[2]) for r in rows]  # the one on w3 (seen measuring there)
    redone = [r for r in rows if r[3] == lost[0][3] and r[1] == "complete"]  # same params and phase
    assert [r[0] for r in redone] == ["w2"], rows  # measured again, on the other M2 Ultra
    assert sum(r[1] == "complete" for r in trials(db, "part")) == 8
    # plugged back: the node was declared dead, so its service manager restarts the worker (the
    # old raylet does not reliably exit by itself within 90 s once the link is back; security.md)
    w3.kill_all()
    join(w3, w3.root / "ray_token", "--simulate", SIM_CHIP, "--time-scale", SIM_TIME_SCALE)
    after = head.spawn(FLEETTUNE, *study[:-len(TUNE) - 2], "--study", "after", *TUNE, "--trials", "4",
                       "--seed", "2", env=head_env(head), log=head.root / "after.log")
    try:
        assert after.wait(timeout=300) == 0, (head.root / "after.log").read_text()[-3000:]
    finally:
        if after.poll() is None:
            after.kill()
            print((head.root / "after.log").read_text()[-5000:])
    hosts = {h for h, state, _, _ in trials(db, "after") if state == "complete"}
    assert hosts == {"w2", "w3"}


# ---------------------------------------------------------------- tuning across hosts, after a partition


def test_tune_all_chips_across_hosts(fleet, lan, model_path):
    """A real `tune --all-chips` from the head's host: the real node measures with llama.cpp, the
    simulated Macs with the model; every study completes."""
    db = lan.head.root / "all.db"
    # the fewest confirmation rounds: they rotate over the chip's nodes. After the cut-off test above w3
    # measures at SIM_TIME_SCALE; run alone, this test meets w3's 20 s trials (about 200 s instead of 40)
    done = lan.head.run(FLEETTUNE, "tune", str(model_path), "--all-chips", "--trials", "3", "--confirm-rounds", "3",
                        "--db", f"sqlite:///{db}", *TUNE, "--prompt-tokens", "16", "--gen-tokens", "4",
                        env=head_env(lan.head), timeout=600)
    rows = trials(db) if db.exists() else []
    assert done.returncode == 0, f"{done.stderr[-2000:]}\n{rows}"
    hosts = {h for h, state, _, _ in rows if state == "complete"}
    assert "w1" in hosts and hosts & {"w2", "w3"}, rows  # the real node and the simulated Macs measured
    assert all(state == "complete" for _, state, _, _ in rows), rows


# ---------------------------------------------------------------- the head lost


def test_the_heads_host_lost_then_a_new_head_resumes(fleet, lan):
    """The head's host vanishes mid-study (off the LAN, then every process killed, as a power
    loss): every worker's raylet gives up and nothing keeps measuring; a new head on that host
    resumes the study from the same results DB once the workers rejoin it."""
    head, sims = lan.head, [lan.hosts["w2"], lan.hosts["w3"]]
    db = head.root / "lost.db"
    study = ["tune", SIM_MODEL, "--chip", SIM_KEY, "--db", f"sqlite:///{db}", "--study", "lost", *TUNE,
             "--trials", "8", "--seed", "3"]
    before = {w.name: trials_in_flight(w) for w in sims}
    driver = head.spawn(FLEETTUNE, *study, log=head.root / "lost.log", env=head_env(head))
    try:
        wait_for(lambda: any(trials_in_flight(w) - before[w.name] for w in sims), 180,
                 "a trial of this study running on a simulated Mac")
        head.link(False)
        head.kill_all(signal.SIGKILL)
        driver.wait(timeout=30)
        for w in lan.workers:  # every worker notices: its raylet exits, nothing measures
            wait_for(lambda w=w: not any("raylet" in c for c in ray_processes(w).values()), 90,
                     f"{w.name}'s raylet giving up on the lost head")
            wait_for(lambda w=w: not measuring(w), 30, f"{w.name}'s measurements stopping")
    finally:
        head.link(True)
    for w in lan.workers:
        w.kill_all()  # Ray's agents outlive their raylet (docs/security.md); a service restart would
    # a new head on the same host and results DB; the workers join it with its new token
    _, token_file = start_head(lan)
    for w in sims:
        join(w, give_token(w, token_file), "--simulate", SIM_CHIP, "--time-scale", SIM_TIME_SCALE)
    fleettune(head, *study, "--resume", timeout=400)
    rows = trials(db, "lost")
    states = [state for _, state, _, _ in rows]
    assert states.count("complete") == 8 and "running" not in states, rows  # none lost, none extra
