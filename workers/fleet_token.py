"""The fleet's Ray token: kept in a 0600 file, handed over by file or environment, never by argv.

Whoever holds the token can run code on every node through Ray, so it is the fleet's root password:
it is never put on a command line (``ps`` shows argv to every local user), never printed unless
asked for (`fleettune head token`), and its file is readable by its owner only. A file found with
wider permissions is narrowed to 0600 before it is read.
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


def read_token_file(path: Path) -> str:
    """The token in ``path``; a file others could read is first set to 0600."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            os.chmod(path, 0o600)
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        raise BadInput(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text or any(c.isspace() for c in text):
        raise BadInput(f"token file {path} does not hold one token")
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
    if default_file is not None and Path(default_file).is_file():
        return read_token_file(default_file)
    return None


def redacted(token: str) -> str:
    """Enough of a token to tell two apart in a log, not enough to use it."""
    return f"{token[:4]}…({len(token)} chars)"
