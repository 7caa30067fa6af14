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

Values are checked and escaped for the file that holds them (issue 24, case 8): a control
character in any value is refused (a newline would start a line of its own in a unit); systemd is
not a shell, so every value is double-quoted with ``\\`` and ``"`` escaped, ``%`` written ``%%``
(specifiers are expanded inside quotes) and, in ExecStart's arguments, ``$`` written ``$$``
(``${VAR}`` is expanded there; not in the command's own path, nor in Environment=). ``--address`` is
HOST:PORT and ``--model`` starts with a GGUF header. The file is written through ``mkstemp`` in its
own folder (a fresh name, O_EXCL, mode 0600) and renamed into place.
"""

from __future__ import annotations

import os
import platform
import plistlib
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from workers import fleet_token
from workers.errors import BadInput
from workers.files import atomic_write
from workers.join import split_address
from workers.models import check_gguf_header

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


def refuse_control_characters(what: str, value: str) -> str:
    """``value`` unchanged; BadInput if it holds a control character (issue 24, case 8)."""
    bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"), None)
    if bad is not None:
        raise BadInput(f"{what} holds a control character ({bad!r}); a service file cannot carry it")
    return value


def command(kind: str, *, address: str | None, model: str | None, port: int) -> list[str]:
    """The fleettune command line the service runs."""
    if address is not None:
        split_address(refuse_control_characters("--address", address))
    if kind == "worker":
        if not address:
            raise BadInput("service install worker needs --address HOST:PORT (the head)")
        return [_fleettune(), "worker", "start", "--address", address]
    if kind == "serve":
        if not model:
            raise BadInput("service install serve needs --model PATH (the GGUF file to serve)")
        refuse_control_characters("--model", model)
        path = check_gguf_header(Path(model).expanduser().resolve())
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
        named_path = Path(refuse_control_characters("--token-file", str(token_file))).expanduser()
        path = Path(os.path.abspath(named_path))  # not resolve(): a link is refused, not followed
        fleet_token.read_token_file(path)
        return {fleet_token.TOKEN_FILE_ENV: str(path)}
    token = os.environ.get(fleet_token.TOKEN_ENV, "").strip()
    return {fleet_token.TOKEN_ENV: token} if token else {}


_SYSTEMD_BARE = re.compile(r"[A-Za-z0-9_@+=:,./-]+")  # a word systemd reads as it stands


def _systemd_quoted(value: str, *, dollar: bool) -> str:
    """``value`` as one systemd word: bare when nothing in it is special, else double-quoted with
    ``\\`` and ``"`` escaped, ``%`` as ``%%`` and, where systemd expands variables (``dollar``), ``$`` as ``$$``."""
    if _SYSTEMD_BARE.fullmatch(value):
        return value
    value = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return '"' + (value.replace("$", "$$") if dollar else value) + '"'


def systemd_exec(argv: list[str]) -> str:
    """ExecStart='s value: the command's path is not variable-expanded, its arguments are."""
    return " ".join([_systemd_quoted(argv[0], dollar=False)] + [_systemd_quoted(a, dollar=True) for a in argv[1:]])


def render(kind: str, *, address: str | None = None, model: str | None = None, port: int = 8080,
           token_file: Path | None = None, system: str | None = None, home: Path | None = None) -> ServiceFile:
    """The service file for ``kind`` on ``system`` (default: this one), not yet written."""
    argv = command(kind, address=address, model=model, port=port)
    system, home = _system(system), home or Path.home()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **token_env(token_file)}
    for name, value in [*env.items(), ("the fleettune command", argv[0])]:
        refuse_control_characters(name, value)
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
    if any(c in argv[0] for c in "\"'\\"):  # systemd's string_is_safe() for an executable's name
        raise BadInput(f"the fleettune command {argv[0]!r} holds a quote or a backslash, which systemd "
                       "refuses in an executable's path; install fleettune elsewhere")
    unit = f"fleettune-{kind}"
    lines = ["[Unit]", f"Description=fleettune {kind}", "After=network-online.target", "", "[Service]"]
    lines += [f"Environment={_systemd_quoted(f'{k}={v}', dollar=False)}" for k, v in env.items()]
    lines += [f"ExecStart={systemd_exec(argv)}"]
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
