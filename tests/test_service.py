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


# ---------------------------------------------------------------- hostile values (issue 24, case 8)

TOKEN = "cd" * 32


def _gguf_header_only(path):
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # the header the check reads
    return path


def _verify(unit) -> None:
    """systemd's own reader: exit 0 and nothing said (a warning is how an injected or broken line shows)."""
    import shutil
    import subprocess

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    said = [line for line in (done.stdout + done.stderr).splitlines()
            if "network-online.target" not in line and "default.target" not in line]
    assert done.returncode == 0 and not said, done.stdout + done.stderr


@pytest.fixture
def hostile_home(home, monkeypatch):
    """A fleettune executable and a token file in folders whose names systemd would expand (the
    executable's without quotes or backslashes: systemd refuses those in an executable's path)."""
    bin_dir = home / "a%z b${HOME}$USER"
    bin_dir.mkdir()
    exe = bin_dir / "fleettune"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    hostile = home / "a%z b${HOME}$USER\"q'\\"
    hostile.mkdir()
    token_file = hostile / "%h.token"
    fleet_token.write_token_file(token_file, TOKEN)
    return home, hostile, exe, token_file


def test_a_systemd_unit_from_hostile_values_reads_back_as_written(hostile_home):
    home, hostile, exe, token_file = hostile_home
    model = _gguf_header_only(hostile / "m%h${HOME}.gguf")
    run("service", "install", "serve", "--model", model, "--address", "127.0.0.1:6379", "--token-file", token_file,
        "--system", "linux")
    unit = home / ".config" / "systemd" / "user" / "fleettune-serve.service"
    text = unit.read_text()
    assert "%h" not in text.replace("%%", "") and "%z" not in text.replace("%%", "")  # no specifier left
    assert "m%%h$${HOME}.gguf" in text  # an argument: % and $ escaped
    env_line = next(line for line in text.splitlines() if fleet_token.TOKEN_FILE_ENV in line)
    assert "/%%h.token" in env_line and "b${HOME}$USER" in env_line  # Environment= expands % only
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line.startswith('ExecStart="' + str(exe).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%"))
    # systemd checks the command exists: only the right escaping of its path (%% but no $$) names it
    _verify(unit)
    assert stat_mode(unit) == 0o600 and [p.name for p in unit.parent.iterdir()] == [unit.name]  # no temp left


def stat_mode(path) -> int:
    import stat

    return stat.S_IMODE(path.lstat().st_mode)


def test_an_unescaped_specifier_is_what_systemd_refuses(hostile_home):
    """The check above can fail: the same unit with its command's path unescaped does not verify."""
    home, hostile, exe, token_file = hostile_home
    run("service", "install", "worker", "--address", "127.0.0.1:6379", "--system", "linux")
    unit = home / ".config" / "systemd" / "user" / "fleettune-worker.service"
    _verify(unit)
    broken = unit.with_name("broken.service")
    broken.write_text(unit.read_text().replace("%%", "%"))
    with pytest.raises(AssertionError):
        _verify(broken)


@pytest.mark.parametrize("where", ["token-file", "token-env", "model", "address", "address-syntax", "not-gguf"])
def test_hostile_values_are_refused_and_nothing_is_written(home, monkeypatch, where, tmp_path):
    good_model = _gguf_header_only(tmp_path / "good.gguf")
    args = ["service", "install", "serve", "--model", good_model, "--address", "127.0.0.1:6379", "--system", "linux"]
    if where == "token-file":
        path = tmp_path / "a\nExecStartPre=touch /tmp/pwned\n.token"
        fleet_token.write_token_file(path, TOKEN)
        args += ["--token-file", path]
    elif where == "token-env":
        monkeypatch.setenv(fleet_token.TOKEN_ENV, "abc\nExecStartPre=/bin/true")
    elif where == "model":
        args[4] = _gguf_header_only(tmp_path / "m\nExecStartPre=touch x.gguf")
    elif where == "address":
        args[6] = "127.0.0.1:6379\nExecStartPre=/bin/true"
    elif where == "address-syntax":
        args[6] = "no port here"
    else:
        notes = tmp_path / "notes.gguf"
        notes.write_text("a text file, not a model")
        args[4] = notes
    out = run(*args, code=2)
    assert out.count("\n") == 1 and out.startswith("error: "), out
    assert not (home / ".config").exists()
