"""`fleettune service install worker|serve`: run the node's worker or server at login, restarted
by the system, so a Mac that reboots comes back into the fleet and serves.

macOS: a launchd LaunchAgent (``~/Library/LaunchAgents/io.fleettune.<kind>.plist``, written with
``plistlib`` and read back to check it), loaded with ``launchctl bootstrap gui/<uid> <plist>``.
Linux: a systemd user unit (``~/.config/systemd/user/fleettune-<kind>.service``), started with
``systemctl --user enable --now``. The worker joins once at login (``ray start`` daemonises); the
server runs in the foreground and is kept alive.

The fleet's token never goes on the service's command line (issue 14). A token file
(``--token-file``, or the one $FLEETTUNE_RAY_TOKEN_FILE names) is named in the service's
environment (FLEETTUNE_RAY_TOKEN_FILE) and read at each start; a token given in
$FLEETTUNE_RAY_TOKEN is copied into the environment, so the file is written readable by its owner
only.
"""

from __future__ import annotations

import os
import platform
import plistlib
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from workers import fleet_token
from workers.errors import BadInput
from workers.files import atomic_write

KINDS = ("worker", "serve")


@dataclass(frozen=True)
class ServiceFile:
    path: Path
    text: bytes
    load: str  # the command that starts it
    unload: str  # the command that stops it


def _fleettune() -> str:
    found = shutil.which("fleettune") or str(Path(sys.executable).with_name("fleettune"))
    return str(Path(found).resolve())


def command(kind: str, *, address: str | None, model: str | None, port: int) -> list[str]:
    """The fleettune command line the service runs."""
    if kind == "worker":
        if not address:
            raise BadInput("service install worker needs --address HOST:PORT (the head)")
        return [_fleettune(), "worker", "start", "--address", address]
    if kind == "serve":
        if not model:
            raise BadInput("service install serve needs --model PATH (the GGUF file to serve)")
        path = Path(model).expanduser().resolve()
        if not path.is_file():
            raise BadInput(f"{model}: no such model file")
        argv = [_fleettune(), "serve", "--model", str(path), "--port", str(port)]
        return argv + (["--address", address] if address else [])
    raise BadInput(f"unknown service {kind!r}; choose worker or serve")


def _system(system: str | None) -> str:
    system = system or platform.system().lower()
    if system not in ("darwin", "linux"):
        raise BadInput(f"services on {system!r} are not supported (macOS launchd, Linux systemd)")
    return system


def token_env(token_file: Path | None) -> dict[str, str]:
    """How the service will find the token: ``token_file`` (checked now: it exists and holds one
    token), else $FLEETTUNE_RAY_TOKEN's value, else the file $FLEETTUNE_RAY_TOKEN_FILE names; none
    (a worker on the head's machine reads the data dir's file)."""
    if token_file is None and not os.environ.get(fleet_token.TOKEN_ENV, "").strip():
        named = os.environ.get(fleet_token.TOKEN_FILE_ENV)
        token_file = Path(named) if named else None
    if token_file is not None:
        path = Path(token_file).expanduser().resolve()
        fleet_token.read_token_file(path)
        return {fleet_token.TOKEN_FILE_ENV: str(path)}
    token = os.environ.get(fleet_token.TOKEN_ENV, "").strip()
    return {fleet_token.TOKEN_ENV: token} if token else {}


def render(kind: str, *, address: str | None = None, model: str | None = None, port: int = 8080,
           token_file: Path | None = None, system: str | None = None, home: Path | None = None) -> ServiceFile:
    """The service file for ``kind`` on ``system`` (default: this one), not yet written."""
    argv = command(kind, address=address, model=model, port=port)
    system, home = _system(system), home or Path.home()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **token_env(token_file)}
    if system == "darwin":
        label = f"io.fleettune.{kind}"
        logs = home / "Library" / "Logs" / "fleettune"
        plist = {"Label": label, "ProgramArguments": argv, "RunAtLoad": True, "EnvironmentVariables": env,
                 "StandardOutPath": str(logs / f"{kind}.log"), "StandardErrorPath": str(logs / f"{kind}.log"),
                 "ProcessType": "Interactive"}
        if kind == "serve":
            plist["KeepAlive"] = True  # restarted whenever it exits
            plist["ThrottleInterval"] = 10
        path = home / "Library" / "LaunchAgents" / f"{label}.plist"
        uid = os.getuid()
        return ServiceFile(path, plistlib.dumps(plist), f"launchctl bootstrap gui/{uid} {shlex.quote(str(path))}",
                           f"launchctl bootout gui/{uid}/{label}")
    unit = f"fleettune-{kind}"
    lines = ["[Unit]", f"Description=fleettune {kind}", "After=network-online.target", "", "[Service]"]
    lines += [f"Environment={shlex.quote(f'{k}={v}')}" for k, v in env.items()]
    lines += [f"ExecStart={shlex.join(argv)}"]
    lines += ["Type=oneshot", "RemainAfterExit=yes"] if kind == "worker" else ["Restart=always", "RestartSec=5"]
    lines += ["", "[Install]", "WantedBy=default.target", ""]
    path = home / ".config" / "systemd" / "user" / f"{unit}.service"
    return ServiceFile(path, "\n".join(lines).encode(), f"systemctl --user daemon-reload && systemctl --user "
                       f"enable --now {unit}", f"systemctl --user disable --now {unit}")


def install(kind: str, **options) -> ServiceFile:
    """Write the service file (owner-only, atomically; a plist is read back with plistlib)."""
    service = render(kind, **options)
    service.path.parent.mkdir(parents=True, exist_ok=True)
    if service.path.suffix == ".plist":
        plistlib.loads(service.text)  # a file launchd cannot read is never put in place
    atomic_write(service.path, service.text, mode=0o600)
    return service


def uninstall(kind: str, *, system: str | None = None, home: Path | None = None) -> ServiceFile | None:
    """Remove the service file; the one removed (None: there was none)."""
    if kind not in KINDS:
        raise BadInput(f"unknown service {kind!r}; choose worker or serve")
    system, home = _system(system), home or Path.home()
    if system == "darwin":
        label = f"io.fleettune.{kind}"
        path = home / "Library" / "LaunchAgents" / f"{label}.plist"
        service = ServiceFile(path, b"", "", f"launchctl bootout gui/{os.getuid()}/{label}")
    else:
        path = home / ".config" / "systemd" / "user" / f"fleettune-{kind}.service"
        service = ServiceFile(path, b"", "", f"systemctl --user disable --now fleettune-{kind}")
    if not path.is_file():
        return None
    path.unlink()
    return service
