"""The fleet's Ray token: kept in a 0600 file, handed over by file or environment, never by argv.

Whoever holds the token can run code on every node through Ray, so it is the fleet's root password:
it is never put on a command line (``ps`` shows argv to every local user), never printed unless
asked for (`fleettune head token`), and its file is readable by its owner only.

Reading a token file (issue 24, case 1): ``lstat`` first; only a regular file owned by this user,
opened without following a link, holding one token, is read; a file found with wider permissions
is narrowed to 0600 through that open descriptor, and only after it proved to hold a token. Anything
refused (a folder, a link, a device, a text that is not one token) keeps its mode.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from workers.errors import BadInput
from workers.files import atomic_write

TOKEN_ENV = "FLEETTUNE_RAY_TOKEN"
TOKEN_FILE_ENV = "FLEETTUNE_RAY_TOKEN_FILE"
TOKEN_BYTES = 32


def generate() -> str:
    return secrets.token_hex(TOKEN_BYTES)


MAX_TOKEN_FILE_BYTES = 4096  # a token is 64 hex digits; a bigger file is not a token file


def read_token_file(path: Path) -> str:
    """The token in ``path``; refused (BadInput, mode untouched) unless it is a regular file of this
    user, not a link, holding one token. A file others could read is then set to 0600 (issue 24, case 1)."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise BadInput(f"token file {path} does not exist") from None
    except OSError as exc:
        raise BadInput(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(before.st_mode):
        raise BadInput(f"token file {path} is a symbolic link; name the file itself")
    if not stat.S_ISREG(before.st_mode):
        raise BadInput(f"token file {path} is not a regular file")
    if before.st_uid != os.geteuid():
        raise BadInput(f"token file {path} belongs to uid {before.st_uid}, not to this user")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInput(f"cannot read token file {path}: {exc.strerror or exc}") from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(opened.st_mode):
            raise BadInput(f"token file {path} was replaced while it was read")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
        try:
            text = data.decode().strip()
        except UnicodeDecodeError:
            raise BadInput(f"token file {path} does not hold one token") from None
        if len(data) > MAX_TOKEN_FILE_BYTES or not text or not text.isprintable() or any(c.isspace() for c in text):
            raise BadInput(f"token file {path} does not hold one token")
        if stat.S_IMODE(opened.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except OSError as exc:
        raise BadInput(f"cannot read token file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return text


def write_token_file(path: Path, token: str) -> None:
    """Replace ``path`` with ``token`` atomically, mode 0600 from the first byte on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, token, mode=0o600)


def resolve(token_file: Path | None, default_file: Path | None) -> str | None:
    """The token to present: ``token_file`` if named, else $FLEETTUNE_RAY_TOKEN, else the file
    named by $FLEETTUNE_RAY_TOKEN_FILE, else the default file when it exists (a worker on the
    head's own machine); None when there is none."""
    if token_file is not None:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(Path(os.environ[TOKEN_FILE_ENV]))
    if default_file is not None and os.path.lexists(default_file):
        return read_token_file(default_file)
    return None


def redacted(token: str) -> str:
    """Enough of a token to tell two apart in a log, not enough to use it."""
    return f"{token[:4]}…({len(token)} chars)"
