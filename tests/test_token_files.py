"""Token files (issue 24, case 1): only a regular file of this user, not a link, holding one token, is
read, and only then narrowed to 0600; a refused file keeps its mode and the command says why in one
line, exit 2. Real files: a text that is not a token, a folder, a symlink, a device node."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from workers import fleet_token, serve
from workers.errors import BadInput

TOKEN = "ab" * 32


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (fleet_token.TOKEN_ENV, fleet_token.TOKEN_FILE_ENV, "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _text_file(folder: Path) -> Path:
    path = folder / "notes.txt"
    path.write_text("these are my notes\nnot a token\n")
    path.chmod(0o644)
    return path


def _folder(folder: Path) -> Path:
    path = folder / "a-folder"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    return path


def _symlink(folder: Path) -> Path:
    target = folder / "real.token"
    target.write_text(TOKEN)
    target.chmod(0o644)
    link = folder / "link.token"
    link.symlink_to(target)
    return link


def _device(folder: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    path = folder / "null"
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own, never the real one
    path.chmod(0o666)
    return path


HOSTILE = {"text": _text_file, "folder": _folder, "symlink": _symlink, "device": _device}


def _modes(path: Path) -> tuple[int, int]:
    """The mode of the entry itself and of what it points to."""
    return stat.S_IMODE(os.lstat(path).st_mode), stat.S_IMODE(os.stat(path).st_mode)


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_refused_token_file_keeps_its_mode_in_every_command(clean_env, monkeypatch, kind):
    path = HOSTILE[kind](clean_env)
    before = _modes(path)
    commands = {
        "service install": ["service", "install", "worker", "--address", "127.0.0.1:6379", "--token-file",
                            str(path), "--system", "linux"],
        "worker start": ["worker", "start", "--address", "127.0.0.1:1", "--token-file", str(path)],
        "head token": ["head", "token", "--token-file", str(path)],
    }
    for name, args in commands.items():
        line = _one_line_exit_2(args)
        assert str(path) in line, (name, line)
        assert _modes(path) == before, name
    assert not (clean_env / ".config" / "systemd").exists()  # nothing written
    monkeypatch.setenv(fleet_token.TOKEN_FILE_ENV, str(path))  # the file the environment names
    line = _one_line_exit_2(["service", "install", "worker", "--address", "127.0.0.1:6379", "--system", "linux"])
    assert str(path) in line
    with pytest.raises(BadInput, match=str(path)):
        serve._use_token()  # `fleettune serve` reads it this way before it joins Ray
    assert _modes(path) == before


def test_a_token_file_of_another_user_is_refused(clean_env):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = clean_env / "theirs.token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    with pytest.raises(BadInput, match="belongs to uid 65534"):
        fleet_token.read_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_good_token_file_is_read_and_only_then_narrowed(clean_env):
    path = clean_env / "fleet.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    out = CliRunner().invoke(main, ["head", "token", "--token-file", str(path)])
    assert out.exit_code == 0 and out.output.strip() == TOKEN
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_big_file_is_not_read_as_a_token(clean_env):
    path = clean_env / "big"
    path.write_text("a" * (fleet_token.MAX_TOKEN_FILE_BYTES + 10))
    path.chmod(0o644)
    with pytest.raises(BadInput, match="does not hold one token"):
        fleet_token.read_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
