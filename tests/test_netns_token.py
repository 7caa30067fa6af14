"""The fleet token's handling without a cluster: its file's mode, how it reaches `worker start`, and
that it is printed only when asked for. (The namespaced tests in test_netns.py check the rest
against a real head.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import fleet
from orchestrator.cli import main
from workers import fleet_token
from workers.errors import BadInput


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_worker_start_refuses_a_token_on_the_command_line():
    result = CliRunner().invoke(main, ["worker", "start", "--address", "127.0.0.1:1",
                                       "--token", "s3cret-value"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0] and "FLEETTUNE_RAY_TOKEN" in lines[0]
    assert "s3cret-value" not in result.output + result.stderr


def test_a_token_file_readable_by_others_is_narrowed_before_use(tmp_path):
    path = tmp_path / "ray_token"
    path.write_text("abc123\n")
    os.chmod(path, 0o644)
    assert fleet_token.read_token_file(path) == "abc123"
    assert mode(path) == 0o600


def test_writing_the_token_replaces_a_wide_file_with_a_0600_one(tmp_path):
    path = tmp_path / "ray_token"
    path.write_text("old")
    os.chmod(path, 0o666)
    fleet_token.write_token_file(path, "new")
    assert path.read_text() == "new" and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["ray_token"]  # no temporary left behind


def test_the_token_comes_from_the_named_file_then_the_environment_then_the_data_dir(tmp_path, monkeypatch):
    named, default = tmp_path / "named", tmp_path / "default"
    named.write_text("from-file")
    default.write_text("from-data-dir")
    monkeypatch.setenv(fleet_token.TOKEN_ENV, "from-env")
    assert fleet_token.resolve(named, default) == "from-file"
    assert fleet_token.resolve(None, default) == "from-env"
    monkeypatch.delenv(fleet_token.TOKEN_ENV)
    monkeypatch.setenv(fleet_token.TOKEN_FILE_ENV, str(named))
    assert fleet_token.resolve(None, default) == "from-file"
    monkeypatch.delenv(fleet_token.TOKEN_FILE_ENV)
    assert fleet_token.resolve(None, default) == "from-data-dir"
    assert fleet_token.resolve(None, tmp_path / "absent") is None
    with pytest.raises(BadInput):
        fleet_token.resolve(tmp_path / "absent", default)
    (tmp_path / "two").write_text("two tokens")
    with pytest.raises(BadInput):
        fleet_token.read_token_file(tmp_path / "two")


def test_head_token_prints_the_token_only_when_asked(tmp_path):
    path = tmp_path / "ray_token"
    missing = CliRunner().invoke(main, ["head", "token", "--token-file", str(path)])
    assert missing.exit_code == 2 and missing.stderr.startswith("error: no token at")
    fleet_token.write_token_file(path, "the-token")
    shown = CliRunner().invoke(main, ["head", "token", "--token-file", str(path)])
    assert shown.exit_code == 0 and shown.output.strip() == "the-token"
    assert fleet.saved_token(path) == "the-token"


@pytest.mark.parametrize("host", ["not-an-ip", "198.51.100.200"])
def test_head_start_refuses_an_address_this_machine_does_not_have(host, tmp_path):
    token = tmp_path / "ray_token"
    result = CliRunner().invoke(main, ["head", "start", "--host", host, "--token-file", str(token),
                                       "--db", f"sqlite:///{tmp_path / 'r.db'}"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --host")
    assert not token.exists()


def test_a_node_name_must_be_a_valid_label():
    from workers.join import plan_join

    assert plan_join("M2 Ultra/76", name="mac-mini.lab_3").labels["fleettune.io/hostname"] == "mac-mini.lab_3"
    for bad in ("", "-x", "a b", "x" * 64, "=cmd()"):
        with pytest.raises(BadInput):
            plan_join("M2 Ultra/76", name=bad)


def test_head_and_workers_start_ray_without_its_unauthenticated_metrics_endpoints(tmp_path, monkeypatch):
    """Ray's Prometheus endpoints (autoscaler, dashboard agent) answer without the token on every
    interface of a LAN node: a head starts Ray with no autoscaler, every fleet Ray process with
    metrics collection off (the namespaced tests check the listeners themselves)."""
    from workers import join

    calls = []
    monkeypatch.setattr(fleet, "run_ray", lambda args, token, env=None: calls.append(
        (args, {**join.ray_env(token), **(env or {})})))
    fleet.head_start(host="127.0.0.1", port=6390, token_file=tmp_path / "ray_token")
    args, env = calls[0]
    assert "--no-monitor" in args and args[args.index("--node-ip-address") + 1] == "127.0.0.1"
    # Ray keeps 127.0.0.1 as the node's address only with clusters off (issue 24, case 10)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["RAY_enable_metrics_collection"] == "0" and env["RAY_AUTH_MODE"] == "token"
    assert join.ray_env(None)["RAY_enable_metrics_collection"] == "0"  # `worker start` too
    assert env["DASHBOARD_METRIC_PORT"] == "65536"  # the dashboard's own endpoint: see below


def test_the_dashboards_metrics_endpoint_fails_to_start_on_the_port_fleettune_gives_it():
    """Ray has no switch for the dashboard's Prometheus endpoint (token-free, every interface off
    loopback); fleettune gives it a port no socket can bind, which Ray's start of it catches and
    logs. Fails loudly when a newer Ray reads the port elsewhere or stops guarding the start."""
    import ast
    import socket

    import ray

    from workers import join

    port = int(join.NO_METRICS_ENV["DASHBOARD_METRIC_PORT"])
    with socket.socket() as sock, pytest.raises(OverflowError):
        sock.bind(("", port))  # what prometheus_client.start_http_server does with it
    root = Path(ray.__file__).parent / "dashboard"
    consts = (root / "consts.py").read_text()
    assert 'DASHBOARD_METRIC_PORT = env_integer("DASHBOARD_METRIC_PORT"' in consts
    guarded = [node for node in ast.walk(ast.parse((root / "head.py").read_text())) if isinstance(node, ast.Try)
               and any(isinstance(h.type, ast.Name) and h.type.id == "Exception" for h in node.handlers)
               and "start_http_server" in ast.unparse(ast.Module(body=node.body, type_ignores=[]))]
    assert guarded, "ray/dashboard/head.py no longer starts its metrics server inside try/except Exception"


def test_a_fixed_trial_duration_is_for_simulated_nodes_only():
    from workers.join import plan_join
    from workers.labels import TRIAL_S_LABEL

    assert plan_join("M2 Ultra/76", trial_s=20).labels[TRIAL_S_LABEL] == "20"
    with pytest.raises(BadInput):
        plan_join(None, trial_s=20)
