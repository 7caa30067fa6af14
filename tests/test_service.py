"""`fleettune service install|uninstall`: the launchd plist and the systemd unit, checked as the
system would read them; bad input refused with nothing written. No server, no Ray."""

from __future__ import annotations

import plistlib

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from workers import fleet_token


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (fleet_token.TOKEN_ENV, fleet_token.TOKEN_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def test_a_mac_serving_agent_is_a_plist_launchd_reads_and_is_kept_alive(home, model_path, monkeypatch):
    monkeypatch.setenv(fleet_token.TOKEN_ENV, "s3cret")  # the token from the environment, never argv
    out = run("service", "install", "serve", "--model", model_path, "--address", "127.0.0.1:6379",
              "--system", "darwin")
    path = home / "Library" / "LaunchAgents" / "io.fleettune.serve.plist"
    assert f"wrote {path}" in out and "launchctl bootstrap gui/" in out and str(path) in out
    with open(path, "rb") as handle:
        plist = plistlib.load(handle)
    assert plist["Label"] == "io.fleettune.serve" and plist["KeepAlive"] is True and plist["RunAtLoad"]
    argv = plist["ProgramArguments"]
    assert argv[1:4] == ["serve", "--model", str(model_path.resolve())] and argv[-2:] == ["--address", "127.0.0.1:6379"]
    assert plist["EnvironmentVariables"]["FLEETTUNE_RAY_TOKEN"] == "s3cret" and "s3cret" not in argv
    assert path.stat().st_mode & 0o077 == 0  # the token is readable by its owner only
    out = run("service", "uninstall", "serve", "--system", "darwin")
    assert "launchctl bootout gui/" in out and not path.exists()


def test_a_linux_worker_is_a_systemd_unit(home):
    out = run("service", "install", "worker", "--address", "127.0.0.1:6379", "--system", "linux")
    path = home / ".config" / "systemd" / "user" / "fleettune-worker.service"
    assert "systemctl --user daemon-reload && systemctl --user enable --now fleettune-worker" in out
    text = path.read_text()
    assert "worker start --address 127.0.0.1:6379" in text and "Type=oneshot" in text
    assert "[Install]\nWantedBy=default.target" in text
    run("service", "uninstall", "worker", "--system", "linux")
    assert not path.exists()


def test_a_token_file_is_named_in_the_service_environment_not_copied(home, monkeypatch):
    token_file = home / "fleet.token"
    fleet_token.write_token_file(token_file, "s3cret-from-file")
    monkeypatch.setenv(fleet_token.TOKEN_ENV, "ignored-when-a-file-is-named")
    run("service", "install", "worker", "--address", "127.0.0.1:6379", "--token-file", token_file,
        "--system", "linux")
    text = (home / ".config" / "systemd" / "user" / "fleettune-worker.service").read_text()
    assert f"Environment={fleet_token.TOKEN_FILE_ENV}={token_file}\n" in text
    assert "s3cret" not in text and fleet_token.TOKEN_ENV + "=" not in text
    monkeypatch.delenv(fleet_token.TOKEN_ENV)
    monkeypatch.setenv(fleet_token.TOKEN_FILE_ENV, str(token_file))  # the same file, named by the environment
    run("service", "install", "worker", "--address", "127.0.0.1:6379", "--system", "linux")
    assert (home / ".config" / "systemd" / "user" / "fleettune-worker.service").read_text() == text


@pytest.mark.parametrize("args", [
    ("install", "worker", "--system", "linux"),  # no head address
    ("install", "serve", "--model", "/no/such.gguf", "--system", "darwin"),
    ("uninstall", "serve", "--system", "darwin"),  # nothing installed
    ("install", "worker", "--address", "127.0.0.1:6379", "--token", "s3cret", "--system", "linux"),  # argv: ps
    ("install", "worker", "--address", "127.0.0.1:6379", "--token-file", "/no/such.token", "--system", "linux"),
])
def test_bad_service_requests_write_nothing(home, args):
    out = run("service", *args, code=2)
    assert out.count("\n") == 1 and "s3cret" not in out
    assert not any(p.is_file() for p in home.rglob("*"))
